"""Tiling and scheduling for the `chunked` backend: which tiles run in which step, and the
per-tile operations (gathers, logits, mask, dropout) its forward and backward passes share.

A *step* pairs a set of distinct query blocks (its lanes) with one key block each and runs as
one batched matmul; only the loop over steps is sequential. Distinct query blocks per step mean
the running softmax state of each lane can be read and written back without conflicts.

Static block map (no segments, implicit positions), known at trace time:
  the non-empty tiles are split into PARTIAL ones (masked) and FULL ones (no mask arithmetic),
  and each group is packed into a `Table` of [steps, lanes] by wrap-around scheduling
  (McNaughton's rule: list the tiles row by row and deal them into lanes of `steps` tiles,
  `steps` being the most tiles any query block has; a query block's tiles are consecutive and at
  most `steps` long, so no step holds two of them). EMPTY tiles never run, a causal mask costs
  half of a full one, and a window of width w costs ~(w / block_kv + 1) tiles per query block,
  whatever the sequence length. Tables run under `lax.scan` (a short one is unrolled), so
  compile time and the live working set do not grow with the number of steps.

Dynamic block map (segments or explicit positions): `DynamicSchedule` gives each query block the
range of key blocks its non-empty tiles lie in; a loop of nk steps runs as many of them as the
longest range (a `lax.switch` skips the rest, and the mask arithmetic of steps whose tiles are
all FULL).

Lanes: a step's working set grows with its lanes (logits [B, K, lanes, G, bq, bk]). With
`max_lanes`, a static table is cut into tables of at most that many lanes, and a dynamic
schedule runs groups of that many query blocks one after another (a `lax.fori_loop`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashmesh.attention import masks, varying
from flashmesh.attention.spec import AttentionInputs, AttentionSpec, compute_dtype

# Tables with at most this many steps are unrolled with static indices (contiguous slices
# instead of gathers): a causal diagonal is one step, a narrow window two.
UNROLL_STEPS = 2


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Step:
    """One step: each active query block (lane) meets one key block.

    q_blocks: the A active query blocks: a slice or a static [A] array; traced [A] in a scanned
      table, where the index nq marks a lane with nothing to do (its writes are dropped).
    kv_blocks: each tile's key block: an int or traced scalar (one block shared by all tiles,
      so the backward pass sums dk and dv inside the matmul), a slice, a static or traced [A]
      array (nk = no tile), or, for dynamic maps, a traced [B, A] array.
    masked: whether the tiles need the element mask.
    valid: dynamic maps only, [B, A]: tiles that are real (the others are masked out entirely).
    first: no step ran before this one, so the running state is still the initial one.
    """

    q_blocks: slice | np.ndarray | jax.Array
    kv_blocks: int | slice | np.ndarray | jax.Array
    masked: bool
    valid: jax.Array | None = None
    first: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
    """A static group of tiles: step t pairs query block q[t, l] with key block kv[t, l] for
    each lane l; padding lanes hold (nq, nk)."""

    q: np.ndarray  # [steps, L] int32
    kv: np.ndarray  # [steps, L] int32
    masked: bool

    @property
    def num_steps(self) -> int:
        return self.q.shape[0]

    def shared_kv(self) -> slice | None:
        """The query blocks, as a slice, if every step has the same consecutive run of them
        meeting one key block (a full or causal map's FULL tiles); else None."""
        run = _compact_rows(self.q[0])
        if isinstance(run, slice) and (self.q == self.q[0]).all() and (self.kv == self.kv[:, :1]).all():
            return run
        return None

    def lane_groups(self, max_lanes: int | None, nq: int) -> list["Table"]:
        """This table cut into tables of at most `max_lanes` lanes, run one after another.

        Wrap-around leaves its padding at the tail of the last lane, so the last group may have
        steps whose lanes are all padding (query block `nq`): those steps are dropped, so every
        step of every table has work.
        """
        lanes = self.q.shape[1]
        if max_lanes is None or lanes <= max_lanes:
            return [self]
        groups = []
        for a in range(0, lanes, max_lanes):
            q, kv = self.q[:, a:a + max_lanes], self.kv[:, a:a + max_lanes]
            busy = (q < nq).any(axis=1)
            groups.append(Table(q[busy], kv[busy], self.masked))
        return groups

    def static_step(self, t: int, nq: int) -> Step:
        real = self.q[t] < nq
        return Step(_compact_rows(self.q[t][real]), _compact_cols(self.kv[t][real]), self.masked)


def _compact_rows(idx: np.ndarray) -> slice | np.ndarray:
    if len(idx) and (np.diff(idx) == 1).all():
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _compact_cols(idx: np.ndarray) -> int | slice | np.ndarray:
    if (idx == idx[0]).all():
        return int(idx[0])
    return _compact_rows(idx)


def _wrap_around(rows: list[np.ndarray], nq: int, nk: int, masked: bool) -> Table:
    """Pack each query block's key blocks `rows[i]` into lanes of `steps` tiles (see module)."""
    steps = max(len(r) for r in rows)
    q = np.concatenate([np.full(len(r), i) for i, r in enumerate(rows)])
    kv = np.concatenate(rows)
    lanes = -(-len(q) // steps)
    pad = lanes * steps - len(q)
    q = np.concatenate([q, np.full(pad, nq)]).reshape(lanes, steps).T
    kv = np.concatenate([kv, np.full(pad, nk)]).reshape(lanes, steps).T
    return Table(q.astype(np.int32), kv.astype(np.int32), masked)


def static_schedule(classes: np.ndarray, max_lanes: int | None = None) -> list[Table]:
    """Tables covering exactly the non-empty tiles of a static block map [1, nq, nk], none
    with more than `max_lanes` lanes (None: no limit)."""
    cls = classes[0]
    nq, nk = cls.shape
    tables = []
    for kind, masked in ((masks.PARTIAL, True), (masks.FULL, False)):
        rows = [np.flatnonzero(r == kind) for r in cls]
        if any(len(r) for r in rows):
            tables += _wrap_around(rows, nq, nk, masked).lane_groups(max_lanes, nq)
    return tables


class DynamicSchedule:
    """Per query block, the range [lo, lo + count) of key blocks holding its non-empty tiles,
    from a traced block map [B, nq, nk]. Step t visits key block lo + t of every query block."""

    def __init__(self, classes: jax.Array):
        self.classes = classes  # [B, A, nk] for the A query blocks (lanes) it schedules
        nk = classes.shape[-1]
        nonempty = classes != masks.EMPTY
        self.lo = jnp.argmax(nonempty, axis=-1).astype(jnp.int32)
        hi = (nk - 1 - jnp.argmax(nonempty[..., ::-1], axis=-1)).astype(jnp.int32)
        self.count = jnp.where(jnp.any(nonempty, axis=-1), hi - self.lo + 1, 0)
        self.num_steps = jnp.max(self.count)

    def lanes(self, q: jax.Array) -> "DynamicSchedule":
        """The schedule of query blocks q [A] only; indices past the end are EMPTY lanes."""
        return DynamicSchedule(jnp.take(self.classes, q, axis=1, mode="fill", fill_value=masks.EMPTY))

    def at(self, t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(key block [B, A], valid [B, A], every tile valid and FULL) of step t."""
        kv = jnp.minimum(self.lo + t, self.classes.shape[-1] - 1)
        cls = jnp.take_along_axis(self.classes, kv[..., None], axis=-1)[..., 0]
        valid = (t < self.count) & (cls != masks.EMPTY)
        return kv, valid, jnp.all(valid & (cls == masks.FULL))


# --------------------------------------------------------------------------------------------
# Block selection along one axis
# --------------------------------------------------------------------------------------------

def _traced(sel) -> bool:
    return isinstance(sel, jax.Array) and not isinstance(sel, np.ndarray)


def _take(x: jax.Array, sel, axis: int) -> jax.Array:
    """Blocks `sel` of x along `axis` (traced lane indices past the end are clipped: those
    lanes compute garbage whose writes `_update` drops)."""
    if isinstance(sel, slice):
        if sel.start == 0 and sel.stop == x.shape[axis]:
            return x
        return lax.slice_in_dim(x, sel.start, sel.stop, axis=axis)
    if isinstance(sel, int):
        return lax.index_in_dim(x, sel, axis, keepdims=False)
    if _traced(sel) and sel.ndim == 0:
        return lax.dynamic_index_in_dim(x, sel, axis, keepdims=False)
    return jnp.take(x, sel, axis=axis, mode="clip")


def _update(x: jax.Array, sel, axis: int, new: jax.Array, *, add: bool, unique: bool) -> jax.Array:
    """x with blocks `sel` along `axis` replaced by (add=False) or increased by `new`.
    unique: the indices are distinct (query lanes), so the scatter needs no atomics."""
    if isinstance(sel, slice) and sel.start == 0 and sel.stop == x.shape[axis]:
        return x + new if add else new
    if isinstance(sel, int) or (_traced(sel) and sel.ndim == 0):
        new = jnp.expand_dims(new, axis)
        if add:
            new = lax.dynamic_slice_in_dim(x, sel, 1, axis) + new
        return lax.dynamic_update_slice_in_dim(x, new, sel, axis)
    if isinstance(sel, slice):
        if add:
            new = _take(x, sel, axis) + new
        return lax.dynamic_update_slice_in_dim(x, new, sel.start, axis)
    ref = x.at[(slice(None),) * axis + (sel,)]
    if add:
        return ref.add(new, mode="drop", unique_indices=unique)
    return ref.set(new, mode="drop", unique_indices=unique)


# --------------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------------

class Tiles:
    """The arrays of one call in blocked layout, and what a step does with them.

    Layouts (A = a step's lanes, G = N // K query heads per key/value head):
      q, do: [B, K, nq, G, bq, H]; rows (m, l, lse, delta): [B, K, nq, G, bq];
      k, v: [B, K, nk, bk, H]; bias: [B|1, N|1, nq, bq, nk, bk]; logits: [B, K, A, G, bq, bk].
    Key/value heads are never repeated: the G query heads sharing one sit in the matmul rows.
    """

    def __init__(self, spec: AttentionSpec, block_q: int, block_kv: int, q, k, v, bias, sink,
                 aux: AttentionInputs, max_lanes: int | None = None):
        self.spec = spec
        self.bq, self.bk = block_q, block_kv
        self.nq, self.nk = -(-spec.q_len // self.bq), -(-spec.kv_len // self.bk)
        self.B, self.K, self.G = spec.batch, spec.num_kv_heads, spec.group_size
        self.q_dtype = q.dtype
        self.mm_dtype = q.dtype  # matmul operands stay in the input dtype (bf16 on tensor cores)
        self.ct = compute_dtype(q.dtype)  # accumulation and softmax arithmetic
        self.v_dim = v.shape[-1]
        self.row_shape = (self.B, self.K, self.nq, self.G, self.bq)
        self.q = self.split_q(q)
        self.k, self.v = self.split_kv(k), self.split_kv(v)
        self.bias = None if bias is None else self.split_bias(bias)
        self.bias_dtype = None if bias is None else bias.dtype
        self.sink = sink
        self.sink_logit = None  # [1, K, 1, G, 1]: the extra softmax term's logit
        if spec.softmax == "off_by_one":
            self.sink_logit = jnp.zeros((1, self.K, 1, self.G, 1), self.ct)
        elif spec.softmax == "learnable":
            self.sink_logit = sink.astype(self.ct).reshape(1, self.K, 1, self.G, 1)
        self.aux = aux
        # Manual mesh axes the inputs vary along (under shard_map): loop carries must too.
        self.axes = varying.varying_axes(q, k, v, bias, sink, aux)
        # At most this many query blocks per step (None: all): bounds a step's working set.
        self.max_lanes = None if max_lanes is None or max_lanes >= self.nq else max_lanes
        classes = masks.block_map(spec, aux, self.bq, self.bk)
        if isinstance(classes, np.ndarray):
            self.schedule = static_schedule(classes, self.max_lanes)
        else:
            self.schedule = DynamicSchedule(jnp.broadcast_to(classes, (self.B, self.nq, self.nk)))

    # -- layouts -------------------------------------------------------------------------------
    def split_q(self, x):  # [B, T, N, H] -> [B, K, nq, G, bq, H]
        x = jnp.pad(x, ((0, 0), (0, self.nq * self.bq - self.spec.q_len), (0, 0), (0, 0)))
        x = x.reshape(self.B, self.nq, self.bq, self.K, self.G, x.shape[-1])
        return x.transpose(0, 3, 1, 4, 2, 5)

    def merge_q(self, x):  # [B, K, nq, G, bq, H] -> [B, T, N, H]
        x = x.transpose(0, 2, 4, 1, 3, 5).reshape(self.B, self.nq * self.bq, self.K * self.G, -1)
        return x[:, :self.spec.q_len]

    def split_kv(self, x):  # [B, S, K, H] -> [B, K, nk, bk, H]
        x = jnp.pad(x, ((0, 0), (0, self.nk * self.bk - self.spec.kv_len), (0, 0), (0, 0)))
        return x.reshape(self.B, self.nk, self.bk, self.K, x.shape[-1]).transpose(0, 3, 1, 2, 4)

    def merge_kv(self, x):  # [B, K, nk, bk, H] -> [B, S, K, H]
        x = x.transpose(0, 2, 3, 1, 4).reshape(self.B, self.nk * self.bk, self.K, -1)
        return x[:, :self.spec.kv_len]

    def split_rows(self, x):  # [B, N, T] -> [B, K, nq, G, bq], padding rows 0
        x = jnp.pad(x, ((0, 0), (0, 0), (0, self.nq * self.bq - self.spec.q_len)))
        return x.reshape(self.B, self.K, self.G, self.nq, self.bq).transpose(0, 1, 3, 2, 4)

    def merge_rows(self, x):  # [B, K, nq, G, bq] -> [B, N, T]
        x = x.transpose(0, 1, 3, 2, 4).reshape(self.B, self.K * self.G, self.nq * self.bq)
        return x[:, :, :self.spec.q_len]

    def split_bias(self, x):  # [B|1, N|1, T, S] -> [B|1, N|1, nq, bq, nk, bk]
        pad_t, pad_s = self.nq * self.bq - self.spec.q_len, self.nk * self.bk - self.spec.kv_len
        x = jnp.pad(x, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)))
        return x.reshape(x.shape[0], x.shape[1], self.nq, self.bq, self.nk, self.bk)

    def merge_bias(self, x):  # [B|1, N|1, nq, bq, nk, bk] -> [B|1, N|1, T, S]
        x = x.reshape(x.shape[0], x.shape[1], self.nq * self.bq, self.nk * self.bk)
        return x[:, :, :self.spec.q_len, :self.spec.kv_len]

    # -- step kinds ----------------------------------------------------------------------------
    @staticmethod
    def _per_batch(step: Step) -> bool:
        return _traced(step.kv_blocks) and step.kv_blocks.ndim == 2

    @staticmethod
    def _shared(step: Step) -> bool:
        kv = step.kv_blocks
        return isinstance(kv, int) or (_traced(kv) and kv.ndim == 0)

    def kv_sub(self, step: Step) -> str:
        """einsum letter of the lane axis in key-side tiles: '' when one key block is shared."""
        return "" if self._shared(step) else "a"

    # -- gathers and scatters ------------------------------------------------------------------
    def q_tiles(self, x, step: Step):
        """The lanes' blocks of a query-side array (q, do, m, l, lse, ...), along axis 2."""
        return _take(x, step.q_blocks, 2)

    def put_q_tiles(self, x, step: Step, new, add: bool = False):
        return _update(x, step.q_blocks, 2, new, add=add, unique=True)

    def kv_tiles(self, x, step: Step):
        """Each lane's key block of a key-side array [B, K, nk, bk, H]: [B, K, bk, H] when
        shared, else [B, K, A, bk, H]."""
        if self._per_batch(step):
            tiles = x[jnp.arange(self.B)[:, None], :, step.kv_blocks]  # [B, A, K, bk, H]
            return jnp.moveaxis(tiles, 1, 2)
        return _take(x, step.kv_blocks, 2)

    def add_kv_tiles(self, x, step: Step, new):
        """x [B, K, nk, bk, H] plus each tile's contribution `new` (shaped as kv_tiles)."""
        if self._per_batch(step):
            return x.at[jnp.arange(self.B)[:, None], :, step.kv_blocks].add(jnp.moveaxis(new, 2, 1))
        return _update(x, step.kv_blocks, 2, new, add=True, unique=False)

    def _tile_index(self, step: Step):
        """Block indices per lane: query [A], key [A] ([1] when shared) or [B, A]."""
        q, kv = step.q_blocks, step.kv_blocks
        if not _traced(q):
            q = np.arange(self.nq, dtype=np.int32)[q]
        if isinstance(kv, int) or isinstance(kv, slice):
            kv = np.arange(self.nk, dtype=np.int32)[kv].reshape(-1)
        elif _traced(kv) and kv.ndim == 0:
            kv = kv.reshape(1)
        return q, kv

    def _element_index(self, step: Step):
        """Query rows [A, bq] and key columns ([A|1, bk] or [B, A, bk]) of each lane, int32
        like segment ids and positions (strict promotion; never int64 under x64)."""
        q, kv = self._tile_index(step)
        xp = np if isinstance(q, np.ndarray) and isinstance(kv, np.ndarray) else jnp
        rows = xp.arange(self.bq, dtype=np.int32).reshape(1, self.bq)
        cols = xp.arange(self.bk, dtype=np.int32).reshape((1,) * kv.ndim + (self.bk,))
        return (q.astype(np.int32)[:, None] * self.bq + rows,
                kv.astype(np.int32)[..., None] * self.bk + cols)

    def bias_tiles(self, step: Step):
        """The bias of each tile, [B|1, K|1, A, G|1, bq, bk] in the compute dtype."""
        b = self.bias
        if self._per_batch(step):
            rows = jnp.arange(self.B)[:, None] if b.shape[0] > 1 else jnp.zeros((self.B, 1), jnp.int32)
            q, _ = self._tile_index(step)
            tiles = b[rows, :, q[None, :], :, step.kv_blocks]  # [B, A, N|1, bq, bk]
        elif isinstance(step.q_blocks, slice) and isinstance(step.kv_blocks, int):
            tiles = jnp.moveaxis(b[:, :, step.q_blocks, :, step.kv_blocks], 2, 1)
        else:
            q, kv = self._tile_index(step)
            kv = jnp.broadcast_to(kv, q.shape) if _traced(kv) or _traced(q) else np.broadcast_to(kv, q.shape)
            tiles = jnp.moveaxis(b.at[:, :, q, :, kv].get(mode="clip"), 0, 1)  # [X, A, N|1, bq, bk]
        kg = (self.K, self.G) if tiles.shape[2] > 1 else (1, 1)
        tiles = tiles.reshape(tiles.shape[0], tiles.shape[1], *kg, self.bq, self.bk)
        return tiles.transpose(0, 2, 1, 3, 4, 5).astype(self.ct)

    def add_bias_tiles(self, dbias, step: Step, ds):
        """dbias [B|1, N|1, nq, bq, nk, bk] plus the logits gradient ds [B, K, A, G, bq, bk],
        summed over the axes along which the bias broadcasts."""
        Bb, Nb = dbias.shape[:2]
        if Nb == 1:
            ds = jnp.sum(ds, axis=(1, 3), keepdims=True)
        ds = ds.transpose(0, 2, 1, 3, 4, 5)  # [B, A, K|1, G|1, bq, bk]
        ds = ds.reshape(ds.shape[0], ds.shape[1], Nb, self.bq, self.bk)
        if self._per_batch(step):
            rows = jnp.arange(self.B)[:, None] if Bb > 1 else jnp.zeros((self.B, 1), jnp.int32)
            q, _ = self._tile_index(step)
            return dbias.at[rows, :, q[None, :], :, step.kv_blocks].add(ds, mode="drop")
        if Bb == 1:
            ds = jnp.sum(ds, axis=0, keepdims=True)
        q, kv = self._tile_index(step)
        kv = jnp.broadcast_to(kv, q.shape) if _traced(kv) or _traced(q) else np.broadcast_to(kv, q.shape)
        return dbias.at[:, :, q, :, kv].add(jnp.moveaxis(ds, 1, 0), mode="drop")

    # -- per-tile arithmetic -------------------------------------------------------------------
    def mask(self, step: Step):
        """Visible pairs of each tile, bool [B|1, 1, A, 1, bq, bk] (masks.element_mask per tile)."""
        q_idx, kv_idx = self._element_index(step)
        spec, aux = self.spec, self.aux

        def one(inputs, qi, ki):  # [bq], [bk] -> [B|1, bq, bk]
            m = masks.element_mask(spec, inputs, qi, ki)
            if m is None:
                return jnp.ones((1, qi.shape[0], ki.shape[0]), bool)
            return jnp.broadcast_to(m, (m.shape[0], qi.shape[0], ki.shape[0]))

        if self._per_batch(step):
            # Key columns differ per batch row: give each row its own mask inputs [1, L].
            rows = dataclasses.replace(aux, dropout_seed=None, q_index=None, kv_index=None, head_index=None)
            per_row = jax.tree.map(lambda x: x[:, None], rows)
            m = jax.vmap(lambda inp, ki: jax.vmap(one, (None, 0, 0))(inp, q_idx, ki)[:, 0])(per_row, kv_idx)
            m = m & step.valid[:, :, None, None]  # [B, A, bq, bk]
        elif self._shared(step):
            m = jnp.moveaxis(jax.vmap(one, (None, 0, None))(aux, q_idx, kv_idx[0]), 0, 1)
        else:
            m = jnp.moveaxis(jax.vmap(one, (None, 0, 0))(aux, q_idx, kv_idx), 0, 1)
        return m[:, None, :, None]

    def logits(self, step: Step) -> tuple[jax.Array, jax.Array | None]:
        """Masked logits [B, K, A, G, bq, bk] (-inf where hidden) and, with a soft cap, the
        tanh(s / cap) the backward pass needs (taken before masking, so never inf)."""
        spec = self.spec
        s = jnp.einsum(f"bkagqd,bk{self.kv_sub(step)}sd->bkagqs", self.q_tiles(self.q, step),
                       self.kv_tiles(self.k, step), preferred_element_type=self.ct) * spec.scale
        if self.bias is not None:
            s = s + self.bias_tiles(step)
        tanh = None
        if spec.logits_soft_cap is not None:
            tanh = jnp.tanh(s / spec.logits_soft_cap)
            s = spec.logits_soft_cap * tanh
        if step.masked:
            # -inf, not a finite fill: e^(s - m) is then exactly 0, and a row that sees no key
            # keeps l = 0, which the forward pass turns into a zero output.
            visible = self.mask(step)
            s = jnp.where(visible, s, -jnp.inf)
            if tanh is not None:  # a bias entry of a hidden pair may be anything: tanh too
                tanh = jnp.where(visible, tanh, 0.0)
        return s, tanh

    def dropout_keep(self, step: Step) -> jax.Array | None:
        """Kept elements, bool [B|1, K, A, G, bq, bk]: masks.dropout_keep at each element's
        (b, n, i, j), so exactly the reference's; None without dropout."""
        if not self.spec.has_dropout:
            return None
        q_idx, kv_idx = self._element_index(step)
        b = jnp.arange(self.B).reshape(-1, 1, 1, 1, 1, 1)
        n = jnp.arange(self.K * self.G).reshape(1, self.K, 1, self.G, 1, 1)  # head n = k * G + g
        i = jnp.asarray(q_idx).reshape(1, 1, -1, 1, self.bq, 1)
        j = jnp.asarray(kv_idx)
        j = j.reshape(-1, 1, j.shape[-2], 1, 1, self.bk)
        n, i, j = masks.dropout_numbers(self.aux, n, i, j)
        return masks.dropout_keep(self.aux.dropout_seed, self.spec.dropout_rate, b, n, i, j)

    def dropout(self, keep: jax.Array | None, x):
        """x with dropped elements zeroed and the rest scaled by 1 / masks.keep_probability."""
        if keep is None:
            return x
        return jnp.where(keep, x * (1.0 / masks.keep_probability(self.spec.dropout_rate)), 0.0)

    # -- the loop ------------------------------------------------------------------------------
    def run(self, step_fn, carry, *others):
        """carry after `carry = step_fn(step, carry)` for every step of the schedule.

        The initial carry is marked as varying like the call's inputs and `others` (arrays the
        steps also read, e.g. the backward pass's cotangents), as loops under shard_map need.
        """
        axes = tuple(sorted(set(self.axes) | set(varying.varying_axes(others)), key=str))
        carry = varying.like(carry, axes)
        if isinstance(self.schedule, DynamicSchedule):
            return self._run_dynamic(step_fn, carry)
        for i, table in enumerate(self.schedule):
            if table.num_steps <= UNROLL_STEPS:
                for t in range(table.num_steps):
                    # The first step follows nothing: a barrier there would only stop XLA
                    # fusing the layout changes of q, k and v into it.
                    step = table.static_step(t, self.nq)
                    if i == t == 0:
                        carry = step_fn(dataclasses.replace(step, first=True), carry)
                    else:
                        carry = step_fn(step, self._after(carry))
            elif (run := table.shared_kv()) is not None:
                carry, _ = lax.scan(lambda c, kv: (step_fn(Step(run, kv, table.masked), c), None),
                                    carry, jnp.asarray(table.kv[:, 0]))
            else:
                carry, _ = lax.scan(lambda c, x: (step_fn(Step(x[0], x[1], table.masked), c), None),
                                    carry, (jnp.asarray(table.q), jnp.asarray(table.kv)))
        return carry

    def _after(self, carry):
        """Ties q, k, v to `carry`, so the next step's tiles are computed after it exists:
        otherwise an unrolled step's logits may be computed early and kept alive (memory)."""
        carry, (self.q, self.k, self.v) = lax.optimization_barrier((carry, (self.q, self.k, self.v)))
        return carry

    def _run_dynamic(self, step_fn, carry):
        """All query blocks in every step; or, with max_lanes, groups of max_lanes query blocks
        one after another (a fori_loop; the last group's lanes past nq are EMPTY, their writes
        dropped)."""
        if self.max_lanes is None:
            return self._run_lanes(self.schedule, slice(0, self.nq), step_fn, carry)
        lanes = self.max_lanes

        def group(g, carry):
            q = g * lanes + jnp.arange(lanes, dtype=jnp.int32)
            return self._run_lanes(self.schedule.lanes(q), q, step_fn, carry)

        return lax.fori_loop(0, -(-self.nq // lanes), group, carry)

    def _run_lanes(self, schedule: DynamicSchedule, q_blocks, step_fn, carry):
        """Steps 0 .. num_steps - 1 of a dynamic schedule. The loop runs to the static bound
        nk and skips the steps past num_steps (a `lax.switch` that passes the carry through):
        a loop of known length can be differentiated in reverse mode, so the backward pass
        itself can be (grad of grad), which a `while_loop` forbids; a skipped step costs one
        branch."""
        def body(t, carry):
            kv, valid, all_full = schedule.at(t)
            branch = jnp.where(t >= schedule.num_steps, 0, jnp.where(all_full, 1, 2))
            return lax.switch(branch, (
                lambda c: c,
                lambda c: step_fn(Step(q_blocks, kv, masked=False), c),
                lambda c: step_fn(Step(q_blocks, kv, masked=True, valid=valid), c)), carry)

        return lax.fori_loop(0, self.nk, body, carry)
