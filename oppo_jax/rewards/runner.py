"""Reward functions on the host, beside the device pipeline.

Per step, ``StepRewards`` follows the actor's decode chunks on one reader thread (reading a
chunk waits on the device there, never in the dispatch loop), keeps each slot's response
tokens, and as soon as a sequence ends (EOS or the length cap) decodes it and hands
``fn(prompt, response, record)`` of every function to a thread pool. So under a streaming
schedule the functions run while the actor is still decoding; without streaming they run
after the cut, while the scorers' device work runs. Before the experience kernel,
``combine`` waits for the batch rows' results and forms

    score = reward.model_weight x reward model + sum_i weight_i x function_i.

A result is used only if the tokens it was computed on are the batch row's final tokens, so
timing never changes a score.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

import jax
import numpy as np

from oppo_jax.parallel.sharding import to_host
from oppo_jax.rewards.functions import RewardFunction, call


class RewardFunctions:
    """The run's reward functions, their thread pool, and how text and records are found."""

    def __init__(
        self,
        functions: list[RewardFunction],
        model_weight: float,
        tokenizer,
        record: Callable[[int], dict],  # prompt_id -> the prompt's dataset record
        eos_ids: tuple[int, ...],
        max_response_len: int,
        skip_nonfinite: bool = False,
        workers: int = 4,
    ):
        self.functions, self.model_weight = functions, model_weight
        self.tokenizer, self.record = tokenizer, record
        self.eos_ids, self.max_response_len = np.asarray(eos_ids), max_response_len
        self.skip_nonfinite = skip_nonfinite
        self.pool = cf.ThreadPoolExecutor(max(workers, 1), thread_name_prefix="reward-fn")

    def text(self, ids) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)

    def submit(self, prompt_id: int, prompt_ids, response_ids, record=None) -> cf.Future:
        """Decode one sequence and queue its functions; the future gives [F] raw values.
        ``record`` defaults to the training prompt's (``prompt_id``) dataset record."""
        prompt, response = self.text(prompt_ids), self.text(response_ids)
        record = self.record(int(prompt_id)) if record is None else record
        where = f"prompt_id {prompt_id}, record {record!r}"[:300]

        def run():
            args = (prompt, response, record, where, self.skip_nonfinite)
            return np.asarray([call(f, *args) for f in self.functions], np.float64)

        return self.pool.submit(run)

    def weighted(self, raw: np.ndarray) -> np.ndarray:
        """[N, F] raw values -> [N] weighted sum."""
        weights = np.asarray([f.weight for f in self.functions], np.float64)
        return raw @ weights if len(self.functions) else np.zeros(raw.shape[0])

    def start(self, slots, started: dict | None = None) -> StepRewards:
        """A collector for one step's slots (a ``SlotBatch``); ``started``: slot -> (tokens,
        future) of sequences whose functions were submitted already (a refilling run's, as
        they ended)."""
        return StepRewards(self, slots, started)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class StepRewards:
    """One step's sequences, followed chunk by chunk; see the module docstring."""

    def __init__(self, owner: RewardFunctions, slots, started: dict | None = None):
        self.owner, self.slots = owner, slots
        self.reader = cf.ThreadPoolExecutor(1, thread_name_prefix="reward-reader")
        p, n = slots.prompt_len, slots.prefix_len
        self.responses = [list(slots.context[s, p[s] : p[s] + n[s]]) for s in range(len(p))]
        self.futures: dict[int, tuple[tuple, cf.Future]] = dict(started or {})
        self.metrics: dict[str, float] = {}
        for s in np.flatnonzero(slots.active & slots.prefix_finished):
            if int(s) not in self.futures:
                self._submit(int(s))  # carried in already complete: score it at once

    def _submit(self, s: int) -> None:
        p, tokens = self.slots.prompt_len[s], tuple(self.responses[s])
        prompt = self.slots.context[s, :p]
        future = self.owner.submit(int(self.slots.prompt_ids[s]), prompt, tokens)
        self.futures[s] = (tokens, future)

    def feed(self, chunk) -> None:
        """Take a decode chunk's tokens (read on the reader thread, not here)."""
        self.reader.submit(self._read, chunk.tokens, chunk.count)

    def _read(self, tokens, count) -> None:
        tokens, count = np.asarray(tokens), np.asarray(count)
        for s in np.flatnonzero(count > 0):
            new = tokens[s, : count[s]]
            self.responses[s].extend(new.tolist())
            ended = np.isin(new[-1], self.owner.eos_ids)
            if ended or len(self.responses[s]) >= self.owner.max_response_len:
                self._submit(int(s))

    def combine(self, scored, decoding, rows: np.ndarray):
        """``scored`` (ScorerOutputs) with its scores replaced by the combined score of each
        slot; the batch ``rows`` get the functions' values (0 elsewhere). Waits for them."""
        self.reader.shutdown(wait=True)  # every chunk fed has been read
        tokens, lengths = to_host((decoding.tokens, decoding.num_generated))
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        raw = np.zeros((len(self.slots.prompt_len), len(self.owner.functions)))
        for s in rows:
            final = tuple(tokens[s, : lengths[s]].tolist())
            kept = self.futures.get(int(s))
            if kept is None or kept[0] != final:  # not seen end (sync schedules) or changed
                prompt = self.slots.context[s, : self.slots.prompt_len[s]]
                kept = (final, self.owner.submit(int(self.slots.prompt_ids[s]), prompt, final))
            raw[s] = kept[1].result()  # re-raises a function's error here
        for f, column in zip(self.owner.functions, raw[rows].T, strict=True):
            self.metrics[f"reward_fn/{f.short_name}"] = float(np.mean(column))
        for _, future in self.futures.values():
            future.cancel()  # sequences past the cut: carried, scored when they end
        total = jax.device_put(np.asarray(self.owner.weighted(raw), np.float32))  # no program
        if scored.scores is not None:
            total = self.owner.model_weight * scored.scores + total
        return scored.replace(scores=total)
