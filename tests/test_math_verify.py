"""The math verifier (``oppo_jax.rewards.math``, issue 45): GSM8K's ``#### n`` and MATH's
``\\boxed{}`` answer forms, answers equal mathematically in other forms, wrong answers and
garbage, the ``extract`` key, the format reward, and a response that would hang math-verify
bounded by the per-call timeout. Calls run on threads, as the reward-function runner's do."""

import concurrent.futures as cf
import time

import pytest

from oppo_jax.base.errors import InputError
from oppo_jax.rewards import RewardFunctionError, call, resolve
from oppo_jax.rewards.math import answer_format, record_reference, verify

GSM8K = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
    "many clips in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
    "<<48+24=72>>72 clips altogether in April and May.\n#### 72",
}
GSM8K_COMMAS = {
    "question": "...",
    "answer": "She earns 1000 + 234 = <<1000+234=1234>>.\n#### 1,234",
}
MATH = {
    "problem": "What is $\\sin 60^\\circ$?",
    "solution": "It is the height of an equilateral triangle of side 1: "
    "$\\boxed{\\frac{\\sqrt{3}}{2}}$.",
}
HALF = ("0.5", "1/2", "\\frac{1}{2}", "\\dfrac12")


def on_threads(fn, *calls):
    """``fn(*args)`` of each call, computed on reward-function-like threads."""
    with cf.ThreadPoolExecutor(4, thread_name_prefix="reward-fn") as pool:
        return [f.result() for f in [pool.submit(fn, *args) for args in calls]]


def test_gsm8k_answers_after_hashes():
    right = [
        "48/2 = 24 in May, 48 + 24 = 72 in all.\n#### 72",
        "#### 72",
        "#### 72.0",
        "so 72 clips\n####  72 \nDone.",
    ]
    wrong = ["#### 71", "72\n#### 24", "#### seventy"]
    got = on_threads(verify, *[("", r, GSM8K) for r in right + wrong])
    assert got == [1.0] * len(right) + [0.0] * len(wrong)
    # commas in numbers, in the reference (raw or bare) and in the response
    cases = [("#### 1,234", GSM8K_COMMAS), ("#### 1234", GSM8K_COMMAS)]
    cases += [("#### 1,234", {"answer": "1234"}), ("#### 1234", {"answer": "1,234"})]
    assert on_threads(verify, *[("", r, rec) for r, rec in cases]) == [1.0] * 4


def test_math_answers_in_boxes():
    right = [
        "So the answer is $\\boxed{\\frac{\\sqrt{3}}{2}}$.",
        "\\boxed{\\frac{\\sqrt3}{2}}",
        "\\boxed{\\dfrac{\\sqrt{3}}{2}}",
        "\\boxed{\\sqrt{3}/2}",
        # the last box (boxes close together, "\\boxed{1}, \\boxed{2}", are read as one set)
        "I first wrote \\boxed{1}, the cosine of 0 degrees, which is not what the question asks "
        "for. The sine of 60 degrees is \\boxed{\\frac{\\sqrt{3}}{2}}",
    ]
    wrong = [
        "\\boxed{\\frac{\\sqrt{2}}{2}}",
        "\\boxed{\\frac{1}{2}}",
        "\\boxed{}",
        "\\boxed{\\sqrt{3}",
    ]
    got = on_threads(verify, *[("", r, MATH) for r in right + wrong])
    assert got == [1.0] * len(right) + [0.0] * len(wrong)


def test_equivalent_forms_are_one_answer():
    calls = [("", f"#### {a}", {"answer": b}) for a in HALF for b in HALF]
    calls += [("", f"\\boxed{{{a}}}", {"reference": b}) for a in HALF for b in HALF]
    assert on_threads(verify, *calls) == [1.0] * len(calls)
    others = ["0.51", "2", "1/3", "\\frac{2}{1}", "-0.5"]
    assert on_threads(verify, *[("", f"\\boxed{{{a}}}", {"answer": "1/2"}) for a in others]) == [
        0.0
    ] * len(others)


def test_garbage_scores_0_and_never_raises():
    garbage = [
        "",
        "I do not know.",
        "####",
        "\\boxed{",
        "}}}{{{\\frac{\\frac{",
        "#### \\boxed{\\boxed{",
        "\x00\x01\x02 ÿ 💥",
        "$$$$ \\\\\\ ^^^ ___",
        "=" * 2000,
    ]
    got = on_threads(verify, *[("", g, GSM8K) for g in garbage])
    assert got == [0.0] * len(garbage)


def test_extract_selects_where_the_answer_is():
    both = "First \\boxed{5}. On reflection:\n#### 3"
    record = {"answer": "5"}
    assert verify("", both, record, extract="boxed") == 1.0
    assert verify("", both, record, extract="gsm8k") == 0.0
    assert verify("", both, record, extract="auto") == 0.0  # #### comes first in auto
    loose = "She has 5 apples and buys 2 more, so she has 7"
    assert verify("", loose, {"answer": "7"}, extract="last_number") == 1.0
    assert verify("", loose, {"answer": "7"}, extract="auto") == 1.0  # no ####, no box
    assert verify("", loose, {"answer": "7"}, extract="gsm8k") == 0.0
    assert verify("", loose, {"answer": "7"}, extract="boxed") == 0.0
    with pytest.raises(ValueError, match=r"extract='hashes': must be one of auto, gsm8k"):
        verify("", loose, {"answer": "7"}, extract="hashes")


def test_format_reward_is_the_answer_in_its_place():
    cases = {
        ("#### 12", "gsm8k"): 1.0,
        ("the answer is 12", "gsm8k"): 0.0,
        ("#### ", "gsm8k"): 0.0,  # the place, but nothing in it
        ("\\boxed{}", "boxed"): 0.0,
        ("\\boxed{12}", "boxed"): 1.0,
        ("#### 12", "boxed"): 0.0,
        ("\\boxed{12}", "auto"): 1.0,
        ("#### 12", "auto"): 1.0,
        ("the answer is 12", "auto"): 0.0,  # auto's place: after #### or in a box
        ("the answer is 12", "last_number"): 1.0,
    }
    got = on_threads(answer_format, *[("", r, {}, e) for r, e in cases])
    assert dict(zip(cases, got, strict=True)) == cases


def test_the_reference_is_read_from_the_record_as_users_have_it():
    assert record_reference(GSM8K) == "72"
    assert record_reference(GSM8K_COMMAS) == "1234"
    assert record_reference(MATH) == "\\frac{\\sqrt{3}}{2}"
    assert record_reference({"answer": " 3.5 "}) == "3.5"
    assert record_reference({"answer": 42}) == "42"
    assert record_reference({"reference": "7", "answer": "#### 8"}) == "7"  # extracted at load
    with pytest.raises(KeyError, match=r"no 'reference' \(data.answer_field\), 'answer'.*question"):
        record_reference({"question": "?"})
    with pytest.raises(ValueError, match=r"the answer \(its 'answer'\) is empty"):
        record_reference({"answer": "#### "})


def test_a_response_that_would_hang_math_verify_is_bounded_by_the_timeout():
    hanging = "\\boxed{9^{9^{9^{9}}}}"  # sympy would compute a number of 10^(3.7e8) digits
    assert on_threads(verify, ("", "#### 5", {"answer": "5"})) == [1.0]  # children started
    start = time.monotonic()
    with pytest.warns(UserWarning, match=r"no verdict within timeout_s=1.0 on response"):
        got = on_threads(verify, ("", hanging, {"answer": "5"}, "auto", 1.0))
    assert got == [0.0] and time.monotonic() - start < 10.0  # 1 s, and slack for a loaded host
    # the killed child is replaced: the next calls are judged as usual
    assert on_threads(verify, ("", "\\boxed{5}", {"answer": "5"}), ("", "#### 4", GSM8K)) == [
        1.0,
        0.0,
    ]


def test_math_verify_own_timeout_does_not_work_on_a_thread():
    """Why the verifier bounds calls with a child process: math-verify's timeouts use
    signal.alarm, which raises off the main thread (where reward functions run)."""
    from math_verify import parse

    with pytest.raises(ValueError, match="doesn't support threaded environment"):
        on_threads(parse, ("\\boxed{5}",))


def test_through_the_reward_function_runner():
    [boxed, fmt] = resolve(
        ["oppo_jax.rewards.math:verify", "oppo_jax.rewards.math:answer_format"],
        [1.0, 0.1],
        [{"extract": "boxed", "timeout_s": 2.0}, {"extract": "gsm8k"}],
    )
    assert call(boxed, "", "\\boxed{72}", GSM8K, "record 0", False) == 1.0
    assert call(fmt, "", "\\boxed{72}", GSM8K, "record 0", False) == 0.0
    with pytest.raises(RewardFunctionError, match=r"math:verify raised KeyError.*on record 3"):
        call(boxed, "", "\\boxed{72}", {"question": "?"}, "record 3", False)
    with pytest.raises(InputError, match=r"reward.kwargs\[0\]=\{'extrakt': 'boxed'\} of .*verify"):
        resolve(["oppo_jax.rewards.math:verify"], [], [{"extrakt": "boxed"}])


def test_a_child_that_ended_while_idle_is_replaced():
    from oppo_jax.rewards import math as math_reward

    assert on_threads(verify, ("", "#### 5", {"answer": "5"})) == [1.0]
    for child in list(math_reward._sandbox.idle):
        child.kill()  # as the OOM killer might
    assert on_threads(verify, ("", "#### 5", {"answer": "5"})) == [1.0]
