"""A chunk's new tokens packed end to end, for a cached call that costs what its tokens cost.

A streamed chunk gives each slot 0..C new tokens; fed as [S, C] rows, a finished slot and the
columns past a slot's count cost as much as real tokens. Packed, the M real tokens (a bucket)
go through every token-wise layer (projections, MLP, norms, heads) as one [1, M] row, and
only attention, which must read each slot's own cache, lays them out again as N rows of C
queries, row n reading slot ``rows[n]``'s cache prefix. Token m sits at row ``token_row[m]``,
column ``token_col[m]`` (its offset in the chunk), so its position is that slot's cache length
plus its column, and its new key is written there; padding tokens name row N (slot S), whose
writes are dropped.

Example: counts [0, 3, 0, 1] (S 4, C 4), N 2, M 4: rows [1, 3], token_row [0, 0, 0, 1],
token_col [0, 1, 2, 0]; the last token of slot 1 is m = 2.

Dimension letters: S slots, N rows, C chunk width, M packed tokens, H heads, Dh head width.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@flax.struct.dataclass
class ChunkLayout:
    """Where each of a chunk's M packed tokens sits among N rows of C columns (docstring)."""

    rows: Int[Array, " N"]  # cache slot of each row (S: a padding row)
    count: Int[Array, " N"]  # new tokens of each row
    token_row: Int[Array, " M"]  # row of each packed token (N: padding)
    token_col: Int[Array, " M"]  # its column: its offset within its row's chunk
    width: int = flax.struct.field(pytree_node=False, default=1)  # C, columns per row

    __no_type_check__ = True  # rebuilt by jax with non-array leaves (see KVCache)

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    def token_slots(self, slots: int) -> Int[Array, " M"]:
        """The cache slot of each packed token (``slots`` for padding)."""
        padded = jnp.concatenate([self.rows, jnp.full((1,), slots, self.rows.dtype)])
        return jnp.take(padded, self.token_row, mode="clip")

    def positions(self, length: Int[Array, " S"]) -> tuple[Int[Array, "1 M"], Int[Array, "N C"]]:
        """(each packed token's position, each row column's position): the slot's cache length
        plus the column (padding rows read the last slot's length; they are never kept)."""
        row_len = jnp.take(length, self.rows, mode="clip")
        cols = jnp.arange(self.width, dtype=jnp.int32)
        tokens = jnp.take(row_len, self.token_row, mode="clip") + self.token_col
        return tokens[None, :], row_len[:, None] + cols[None, :]

    def to_rows(self, x: Float[Array, "M H Dh"]) -> Float[Array, "N C H Dh"]:
        """Packed tokens laid out in their rows (zeros where no token sits)."""
        rows = jnp.zeros((self.num_rows, self.width, *x.shape[1:]), x.dtype)
        return rows.at[self.token_row, self.token_col].set(x, mode="drop")

    def from_rows(self, x: Float[Array, "N C H Dh"]) -> Float[Array, "M H Dh"]:
        """The packed tokens read back from their rows (padding tokens read garbage)."""
        return x[jnp.minimum(self.token_row, self.num_rows - 1), self.token_col]

    def is_last(self) -> Array:
        """[M] whether each packed token is its row's last new token."""
        count = jnp.take(self.count, self.token_row, mode="fill", fill_value=0)
        return (self.token_col == count - 1) & (self.token_row < self.num_rows)
