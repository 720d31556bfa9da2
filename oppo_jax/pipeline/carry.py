"""Inter-step overlap bookkeeping on the host: admission, the cut, and the carried buffer.

A step admits up to B + Δ·G sequences in groups of G (G responses to one prompt, with sample
indices 0..G-1; G = 1 for PPO): carried groups first (FIFO), then new prompts, each group in
G contiguous slots. All slots decode in lockstep; the step's rollout ends at the decode
position where the (B/G)-th group completes (a group completes with its last member). The
batch is those B/G whole groups in a fixed order — groups that must finish first, then by
completion position, then by admission order — and every other group is carried whole: its
finished members complete, the others with the tokens they had at the cut.

Staleness: each carried token keeps the step (policy version) that sampled it, so a token
trained at step k sampled at step v is k − v versions stale (``staleness_counts``). A group
carried d times holds tokens up to d versions old, so ``AdmitRule.max_staleness`` bounds d: a
group carried that often is at the bound, and either must finish in its step (on_stale
``finish``) or, if the cut leaves it out, is dropped whole (``drop``; ``dropped_slots``).
Nothing here touches a device: it is plain Python over small integer arrays, so its
invariants are property-tested directly.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class Carried:
    """A sequence waiting for the next step, with the work it has done so far."""

    prompt_id: int
    prompt: list[int]  # prompt tokens
    response: list[int]  # response tokens sampled so far
    behaviour_logp: list[float]  # log-prob of each response token when it was sampled
    version: list[int]  # step (policy version) that sampled each response token
    deferrals: int  # steps this sequence has been carried so far
    finished: bool = False  # completed (EOS or max length) but not taken into a batch yet
    sample_index: int = 0  # which of its prompt's G samples (its sampling keys' index)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class CarryBuffer:
    """FIFO of carried sequences; its state is plain JSON (it goes into checkpoints).

    ``kept`` holds the frozen scorers' device state of the carried rows
    (``oppo_jax.scoring.carried.KeptCaches``, or None): it goes into checkpoints as arrays.
    """

    def __init__(self, items: list[Carried] | None = None):
        self._items = collections.deque(items or [])
        self.kept = None  # KeptCaches of the sequences carried by the last step

    def __len__(self) -> int:
        return len(self._items)

    def take(self, k: int) -> list[Carried]:
        """The oldest ``k`` carried sequences (fewer if fewer wait)."""
        return [self._items.popleft() for _ in range(min(k, len(self._items)))]

    def extend(self, items: list[Carried]) -> None:
        self._items.extend(items)

    def state(self) -> list[dict]:
        return [c.to_json() for c in self._items]

    @classmethod
    def from_state(cls, state: list[dict]) -> CarryBuffer:
        return cls([Carried(**c) for c in state])


@dataclasses.dataclass
class Selection:
    """Which slots form the batch, and where the rollout was cut."""

    batch: np.ndarray  # slot indices of the B sequences, in batch order
    cut: int  # decode position (lockstep clock) at which the rollout ends


def select_batch(
    finish_step: np.ndarray,
    active: np.ndarray,
    must_finish: np.ndarray,
    batch_size: int,
    group_size: int = 1,
) -> Selection | None:
    """Choose the batch once enough groups have finished; None if the rollout must go on.

    ``finish_step[s]`` is the lockstep decode position at which slot s finished (-1 while
    running; 0 if it was already complete when admitted). Slots are in admission order, slot
    s in group s // ``group_size``; a group completes at its last member's finish.

    Example (G = 1): finish_step [3, -1, 1, 3], all active, none must finish, B = 2 -> batch
    [2, 0], cut 3 (slot 3 also finished at 3 but was admitted after slot 0, so it is carried).
    """
    g = group_size
    # [groups, G] views; slots past the last whole group are empty (S is rounded up to shard)
    whole = len(finish_step) // g * g
    finish, member, must = (x[:whole].reshape(-1, g) for x in (finish_step, active, must_finish))
    done = member.any(axis=1) & ~(member & (finish < 0)).any(axis=1)
    urgent = (must & member).any(axis=1)
    if np.any(urgent & ~done) or done.sum() < batch_size // g:
        return None
    ids = np.flatnonzero(done)
    finish = finish.max(axis=1)  # a group completes with its last member
    # Lexicographic: must-finish first, then completion position, then admission order.
    order = np.lexsort((ids, finish[ids], ~urgent[ids]))
    taken = ids[order[: batch_size // g]]
    batch = (taken[:, None] * g + np.arange(g)[None, :]).reshape(-1)
    return Selection(batch=batch, cut=int(finish_step[batch].max()) if len(batch) else 0)


def prompt_sharing(num_slots: int, group_size: int) -> int:
    """Slots sharing each prompt's prefill in an admission of ``num_slots`` slots holding
    groups of ``group_size`` samples (``SlotBatch.shared_prompts``): G when S is a multiple
    of G > 1, else 1. Example: (12, 4) -> 4; (10, 4) -> 1."""
    return group_size if group_size > 1 and num_slots % group_size == 0 else 1


@dataclasses.dataclass
class SlotBatch:
    """The host's view of one step's slots (S = B + Δ_max), in admission order."""

    context: np.ndarray  # [S, W] prompt then carried response prefix, right-padded
    prompt_len: np.ndarray  # [S]
    prefix_len: np.ndarray  # [S] response tokens carried in (0 for new prompts)
    prefix_finished: np.ndarray  # [S] bool: carried in already complete
    prefix_behaviour: np.ndarray  # [S, R] sampling-time log-probs of the prefix tokens
    prefix_version: np.ndarray  # [S, R] policy version (step) that sampled each prefix token
    prompt_ids: np.ndarray  # [S]
    sample_index: np.ndarray  # [S] which of its prompt's G samples each slot holds
    deferrals: np.ndarray  # [S] times each sequence has been carried so far
    active: np.ndarray  # [S] bool: slot holds a sequence
    must_finish: np.ndarray  # [S] bool: at the staleness bound, on_stale finish
    drop_if_left: np.ndarray  # [S] bool: at the staleness bound, on_stale drop
    entries: list  # [S] Carried (or None for empty slots): what to carry out

    @property
    def num_slots(self) -> int:
        return len(self.prompt_len)

    @property
    def carrying(self) -> np.ndarray:
        """[S] bool: the slot brings work from an earlier step (a prefix, or a whole response)."""
        return (self.prefix_len > 0) | self.prefix_finished

    def shared_prompts(self, group_size: int) -> int:
        """G when the admission may prefill each group's prompt once (``group_size`` G > 1,
        slots gG .. gG + G - 1 each empty or all holding samples of one prompt, as ``admit``
        lays groups out), else 1 (G = 1, or S not a multiple of G: every slot prefilled).
        Raises if a group of slots mixes prompts or empty slots: the carry's layout broken."""
        g = prompt_sharing(self.num_slots, group_size)
        if g == 1:
            return 1
        ids = np.where(self.active, self.prompt_ids, -1).reshape(-1, g)
        if np.any(ids != ids[:, :1]):
            raise RuntimeError(f"admitted slots are not whole groups of {g}: prompt ids {ids}")
        return g

    def check_carried_first(self) -> None:
        """Raise unless carried sequences fill the leading slots and no other slot brings
        work: the frozen scorers' kept rows are restored into the leading slots, and the
        replay of carried prefixes runs over leading row buckets (``scoring.carried``)."""
        from_buffer = self.deferrals > 0
        n = int(from_buffer.sum())
        if not from_buffer[:n].all() or (self.carrying & ~from_buffer).any():
            raise AssertionError("carried sequences must fill the leading slots, before new ones")


@dataclasses.dataclass(frozen=True)
class AdmitRule:
    """How one step fills its slots."""

    num_sequences: int  # B + Δ·G sequences to start
    num_slots: int  # S >= num_sequences (rounded up so slots shard evenly; the rest stay empty)
    room_for_prefix: bool  # contexts get R columns for carried prefixes (carrying is on)
    # versions a trained token may be stale (``rollout.max_staleness``): a sequence carried
    # this often is at the bound in this step
    max_staleness: int
    group_size: int = 1  # G, samples of each new prompt (contiguous slots)
    on_stale: str = "finish"  # at the bound: finish (must finish) | drop (dropped if left out)


def admit(
    buffer: CarryBuffer,
    prompts,
    rule: AdmitRule,
    prompt_width: int,
    response_len: int,
    pad_id: int = 0,
) -> SlotBatch:
    """Fill ``rule.num_sequences`` of ``rule.num_slots`` slots: carried first (FIFO), then new
    prompts, each G times (sample indices 0..G-1). Carried groups stay whole: the buffer only
    ever holds whole groups in order, and both counts are multiples of G.

    ``prompts`` has ``take(k)`` -> [(prompt_id, tokens)]. The context is P wide, P + R when
    ``rule.room_for_prefix`` (one width for every step of a carrying run: the admission
    prefills the prompts and replays each prefix at its own length, ``scoring.carried``).
    """
    n, num_slots, g = rule.num_sequences, rule.num_slots, rule.group_size
    entries: list = buffer.take(n)
    for prompt_id, tokens in prompts.take((n - len(entries)) // g):
        prompt = [int(t) for t in tokens]
        entries += [Carried(int(prompt_id), prompt, [], [], [], 0, False, i) for i in range(g)]
    room = response_len if rule.room_for_prefix else 0
    s = SlotBatch(
        context=np.full((num_slots, prompt_width + room), pad_id, np.int32),
        prompt_len=np.zeros(num_slots, np.int32),
        prefix_len=np.zeros(num_slots, np.int32),
        prefix_finished=np.zeros(num_slots, bool),
        prefix_behaviour=np.zeros((num_slots, response_len), np.float32),
        prefix_version=np.zeros((num_slots, response_len), np.int32),
        prompt_ids=np.zeros(num_slots, np.int64),
        sample_index=np.zeros(num_slots, np.int32),
        deferrals=np.zeros(num_slots, np.int32),
        active=np.zeros(num_slots, bool),
        must_finish=np.zeros(num_slots, bool),
        drop_if_left=np.zeros(num_slots, bool),
        entries=entries + [None] * (num_slots - len(entries)),
    )
    for i, c in enumerate(entries):
        row = c.prompt + c.response
        s.context[i, : len(row)] = row
        s.prompt_len[i], s.prefix_len[i] = len(c.prompt), len(c.response)
        s.prefix_finished[i], s.prompt_ids[i], s.deferrals[i] = c.finished, c.prompt_id, c.deferrals
        s.sample_index[i] = c.sample_index
        s.prefix_behaviour[i, : len(c.response)] = c.behaviour_logp
        s.prefix_version[i, : len(c.response)] = c.version
        s.active[i] = True
        at_bound = c.deferrals >= rule.max_staleness  # one more carry would exceed it
        s.must_finish[i] = at_bound and rule.on_stale == "finish"
        s.drop_if_left[i] = at_bound and rule.on_stale == "drop"
    return s


@dataclasses.dataclass
class HostRollout:
    """What the host reads back of a finished rollout, for every slot (NumPy)."""

    tokens: np.ndarray  # [S, R] response tokens
    logprobs: np.ndarray  # [S, R] log-probs recorded by this step's decode/admission
    num_generated: np.ndarray  # [S] response tokens at the end of decoding
    finish_step: np.ndarray  # [S] decode position at which each slot finished (-1: running)


def _left_out(slots: SlotBatch, selection: Selection) -> np.ndarray:
    """[S] bool: active slots the batch did not take."""
    left = slots.active.copy()
    left[selection.batch] = False
    return left


def carried_slots(slots: SlotBatch, selection: Selection) -> list[int]:
    """The slots ``carry_out`` carries, in its order (admission order): active, not taken, not
    dropped (``dropped_slots``)."""
    return np.flatnonzero(_left_out(slots, selection) & ~slots.drop_if_left).tolist()


def dropped_slots(slots: SlotBatch, selection: Selection) -> list[int]:
    """The slots dropped at the cut: at the staleness bound with on_stale drop, not taken.
    Whole groups: a group's members are admitted, taken and carried together, so they share
    their deferrals."""
    return np.flatnonzero(_left_out(slots, selection) & slots.drop_if_left).tolist()


def staleness_counts(
    slots: SlotBatch, rows: np.ndarray, response_len: np.ndarray, step: int, bound: int
) -> np.ndarray:
    """[bound + 1] how many of the batch's trained response tokens were sampled 0, 1, ...
    ``bound`` policy versions before ``step`` (the batch's slots ``rows``, their response
    lengths ``response_len``): a carried prefix token's version is the step that sampled it
    (``SlotBatch.prefix_version``), every later token was sampled in ``step``.

    Example: step 5, one row with a 3-token prefix sampled at steps [3, 3, 4] and 5 tokens in
    all, bound 2 -> [2, 1, 2]. Raises if a token is staler than ``bound`` (the carry's rule
    keeps every one within it).
    """
    width = slots.prefix_version.shape[1]
    cols = np.arange(width)[None, :]
    prefix = cols < slots.prefix_len[rows][:, None]
    trained = cols < np.asarray(response_len)[:, None]
    age = np.where(prefix, step - slots.prefix_version[rows], 0)[trained]
    if age.size and (age.min() < 0 or age.max() > bound):
        raise AssertionError(f"a trained token is {age.max()} versions stale; bound {bound}")
    return np.bincount(age, minlength=bound + 1)


def carry_out(
    slots: SlotBatch, selection: Selection, rollout: HostRollout, step: int
) -> list[Carried]:
    """The sequences not taken into the batch, cut at ``selection.cut``, in admission order.

    A running slot keeps the tokens it had at the cut (prefix + cut new tokens); one that
    finished at or before the cut but did not fit into the batch is carried complete. Tokens
    sampled in this ``step`` are stamped with it as their policy version.
    """
    out = []
    for i in carried_slots(slots, selection):
        generated = int(rollout.num_generated[i])
        done = 0 <= rollout.finish_step[i] <= selection.cut
        keep = generated if done else min(int(slots.prefix_len[i]) + selection.cut, generated)
        n0 = int(slots.prefix_len[i])
        entry = slots.entries[i]
        out.append(
            Carried(
                prompt_id=entry.prompt_id,
                prompt=entry.prompt,
                response=[int(t) for t in rollout.tokens[i, :keep]],
                behaviour_logp=entry.behaviour_logp
                + [float(x) for x in rollout.logprobs[i, n0:keep]],
                version=entry.version + [step] * (keep - n0),
                deferrals=entry.deferrals + 1,
                finished=bool(done),
                sample_index=entry.sample_index,
            )
        )
    return out
