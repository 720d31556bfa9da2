"""The cost model: seconds per unit of work of each PPO-RLHF stage, on one device group.

``oppo_tools.sim.work`` counts what a step computes under an engine; a CostModel prices it:

    decode chunk   = decode_chunk_s + a·steps + b·Σ slots + c·Σ slots × context
    scorers' call  = p0 per scorer call + p1 per token (tokens summed over the scorers)
    admission      = q0 + q1·tokens            the actor's prefill of prompts + carried prefixes
    build_s                                    the PPO batch, once the scores are in
    update         = u0 + u1·tokens            PPO epochs × minibatches over the batch
    copy_s                                     after the update: parameter copy, host tail

``a`` is the weight read of a memory-bound decode step, ``b`` per-slot compute, ``c`` the
KV-cache read per context position. The host_* delays and the overlap rate describe the
machine the steps ran on (``oppo_tools.sim.fitting`` fits them); roofline projections
(``oppo_tools.sim.roofline``) leave them at 0 and 1 and say PROJECTION.
"""

from __future__ import annotations

import dataclasses

Num = int | float


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Stage costs in seconds (equations in the module docstring)."""

    decode_a: float = 0.0  # s per decode step that runs the model
    decode_b: float = 0.0  # s per decode step per slot
    decode_c: float = 0.0  # s per decode step per slot per context token
    decode_chunk_s: float = 0.0  # s per decode chunk (dispatch, loop set-up, the host's read)
    prefill_p0: float = 0.0  # s per scorer call
    prefill_p1: float = 0.0  # s per token per scorer
    n_scorers: int = 3  # reference, critic, reward (2 with a rule-based reward)
    trained_scorers: int = 1  # of those, trained ones (the critic): they re-prefill carried rows
    admit_p0: float = 0.0  # s per actor admission prefill
    admit_p1: float = 0.0  # s per admitted token (prompt + carried prefix)
    build_s: float = 0.0  # s per step building the PPO batch (after the scores arrive)
    update_u0: float = 0.0  # s per update (optimizer steps' memory traffic, dispatch)
    update_u1: float = 0.0  # s per update token the engine computes (all epochs and models)
    update_a: float = 0.0  # s per query-key pair the update's attention computes (likewise)
    copy_s: float = 0.0  # s per step after the update (parameter copies, host tail)
    host_admit_s: float = 0.0  # s of host work before the actor prefill is dispatched
    host_setup_s: float = 0.0  # s more before the first decode chunk is dispatched
    host_stream_s: float = 0.0  # s more when streaming (dispatching the scorers' admissions)
    host_collect_s: float = 0.0  # s not streaming: from the host's read of the cut to scoring
    host_dispatch_s: float = 0.0  # s not streaming: from that read to all scoring dispatched
    host_finish_s: float = 0.0  # s from the last decode chunk (and the above) to the build
    host_update_s: float = 0.0  # s from the build's dispatch to the update's
    overlap_rate: float = 1.0  # speed of either group's work while the other group works too
    label: str = ""  # where the numbers come from; "PROJECTION ..." for roofline models

    def decode_step_s(self, slots: Num, ctx: Num) -> float:
        """One lockstep decode step of ``slots`` slots reading ``ctx`` context positions each."""
        return self.decode_a + self.decode_b * slots + self.decode_c * slots * ctx

    def decode_s(self, steps: Num, slot_steps: Num, ctx_reads: Num) -> float:
        """One decode chunk of ``steps`` model steps over ``slot_steps`` slots in all, reading
        ``ctx_reads`` context positions in all."""
        a, b, c = self.decode_a, self.decode_b, self.decode_c
        return self.decode_chunk_s + a * steps + b * slot_steps + c * ctx_reads

    def prefill_s(self, tokens: Num) -> float:
        """One scorer's prefill of ``tokens`` tokens (one call)."""
        return self.prefill_p0 + self.prefill_p1 * tokens

    def scorers_s(self, tokens: Num) -> float:
        """Every scorer's prefill of the same ``tokens`` tokens, one after another."""
        return self.n_scorers * self.prefill_s(tokens)

    def scoring_s(self, tokens: Num) -> float:
        """One call of every scorer, one after another on their group, over ``tokens`` tokens
        in all (summed over the scorers)."""
        return self.n_scorers * self.prefill_p0 + self.prefill_p1 * tokens

    def copy_kv_s(self, positions: Num) -> float:
        """Copying ``positions`` cache positions' K and V into other slots (a group's shared
        prompt): each read and written at the decode's cache-read rate (``kv_copy_s``)."""
        return kv_copy_s(self.decode_c, positions)

    def admit_s(self, tokens: Num) -> float:
        """The actor's admission prefill of ``tokens`` tokens."""
        return self.admit_p0 + self.admit_p1 * tokens

    def update_s(self, tokens: Num, pairs: Num = 0.0) -> float:
        """The PPO update over ``tokens`` computed batch tokens whose attention computes
        ``pairs`` query-key pairs."""
        return self.update_u0 + self.update_u1 * tokens + self.update_a * pairs

    def to_dict(self) -> dict:
        """Plain JSON form."""
        return dataclasses.asdict(self)


def kv_copy_s(decode_c: float, positions: Num) -> float:
    """Seconds to copy ``positions`` cache positions' K and V at ``decode_c`` seconds per
    position read (``CostModel.decode_c``): K and V, 2 reads a position. One formula for the
    built engine's shared prompt (``sim.events``), the refill rows (``sim.refill``) and the
    calibration, which takes the copies out before it fits the admission (``sim.fitting``)."""
    return 2 * decode_c * positions
