"""This rank's KV shard: per layer k/v plus the global positions it holds.

Under context parallelism a rank holds only part of the sequence, so positions are stored next to
the keys rather than implied by the index; attention masks by position. `fp8=True` stores e4m3 keys
and values with per-(KV head, token) scales (LayerKV says why).

Trimmed local layers (`windows=`, opt-in: LocalRunner.new_cache(trim_local=True)): a sliding-window
layer keeps only the keys a later query can still see. Since every kernel masks by stored position, not
by row order, the rows need not be in order: single-token writes go round a fixed-capacity ring
(overwriting the oldest row, CUDA-graph friendly), and a multi-row block first moves the last
`window - 1` rows to the front, then appends. Such a cache holds a window, not the sequence: whatever
reads a whole cache (context strategies) must not get one. The service's context cache trims its entries
itself once their prefill ends (`KVCache.compact_local`): each local layer keeps the keys a continuation
after the document sees (serving/context_cache.py served_prefix); its host and disk tiers copy such a
cache with each layer's rows and window (serving/host_tier.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from starshard.kernels.fp8 import FP8_DTYPE, dequantize, quantize_rows
from starshard.kernels.kv_write import use_kv_write_kernel, write_kv_block, write_kv_slot, write_kv_slot_reference


def token_major(batch: int, n_kv_heads: int, rows: int, head_dim: int, dtype, device) -> torch.Tensor:
    """An uninitialized [batch, n_kv_heads, rows, head_dim] tensor stored token-major ([batch, rows, heads,
    head_dim] in memory). Why: a view of the first n rows then has head and row strides set by (heads,
    head_dim) alone, not by the cache's capacity, which is the prompt's length; torch keys its cuDNN
    attention plans by strides, so with head-major rows every document length paid a plan build (46-65 ms
    on one H200) in every chunk step of its prefill (issue 47)."""
    return torch.empty(batch, rows, n_kv_heads, head_dim, dtype=dtype, device=device).transpose(1, 2)


@dataclass
class StoredKV:
    """What a LayerKV holds, as stored: k, v [B, Hkv, n, D] (e4m3 for an FP8 cache) with positions [n];
    k_scale, v_scale [B, Hkv, n] float32 for FP8 (None otherwise). `attention(q, s.k, s.v, ...,
    k_scale=s.k_scale, v_scale=s.v_scale)` reads it either way."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def rows(self, a: int, b: int | None = None) -> "StoredKV":
        """Entries [a, b) (b None: to the end), their scales with them; views, no copy."""
        cut = slice(a, b)
        fp8 = self.k_scale is not None
        return StoredKV(self.k[:, :, cut], self.v[:, :, cut], self.pos[cut],
                        self.k_scale[:, :, cut] if fp8 else None, self.v_scale[:, :, cut] if fp8 else None)


def _head_major(batch: int, n_kv_heads: int, rows: int, head_dim: int, dtype, device) -> torch.Tensor:
    return torch.empty(batch, n_kv_heads, rows, head_dim, dtype=dtype, device=device)


def _rows_like(t: torch.Tensor, rows: int) -> torch.Tensor:
    """An empty tensor like a LayerKV part `t` (k / v in its layout, positions, scales) with `rows` rows."""
    if t.dim() == 4 and not t.is_contiguous():
        return token_major(t.shape[0], t.shape[1], rows, t.shape[3], t.dtype, t.device)
    return t.new_empty(*t.shape[:2], rows, t.shape[3]) if t.dim() == 4 else t.new_empty(*t.shape[:-1], rows)


class LayerKV:
    """Preallocated k/v/positions for one layer; grows by doubling if a run outlasts its capacity.

    fp8: keys and values are stored in e4m3 (1 byte) with one float32 scale per (KV head, token):
    scale = amax of that head's D values / 448 (kernels/fp8.py quantize_rows). Why per token rather
    than one scale per head fixed at the first write: an entry's bytes then depend on that key
    alone, so every strategy and rank stores the same bytes for the same key whatever order or shard
    it is written in (ring, Ulysses, Star, APB and dense agree), nothing ever clips when a later token
    is larger than the first ones, and no stored entry is rescaled for the rest of the run. The scale
    costs 4 bytes per 128 stored (about 3 %).
    Reads: `stored()` hands the e4m3 bytes and scales to attention (the Triton kernels dequantize in
    registers); `append_stored()` stores a prefill block and hands back the entries held before it
    as stored, the block attending its own keys as given (kernels/attention.py attention_after_held):
    a chunked prefill never holds a compute-dtype copy of the prefix. `append()` / `view()` hand back
    the compute dtype (held entries dequantized: a transient copy of the prefix; the entries just
    appended as given). Either way a prefill attends its own keys exactly, as every context
    strategy's prefill does with the keys it computes or receives.
    """

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, capacity: int, dtype, device, fp8: bool = False,
                 window: int | None = None):
        self.dtype = dtype  # what attention computes in
        # Trimmed (a local layer's sliding window): keeps only the last window - 1 keys plus what one
        # forward appends (module docstring); None: keeps every key.
        if window is not None and window < 1:
            raise ValueError(f"LayerKV window must be >= 1 keys, got {window}")
        self.window = window
        self.head = 0  # trimmed: the row the next single-token write takes (the oldest row once full)
        self.fp8 = fp8
        store = FP8_DTYPE if fp8 else dtype
        # An e4m3 cache stays head-major: its prefill reads dequantized copies (strides of their own) and its
        # decode kernel loads a head's rows through tensor descriptors over contiguous rows.
        alloc = token_major if not fp8 else _head_major
        self.k = alloc(batch, n_kv_heads, capacity, head_dim, store, device)
        self.v = alloc(batch, n_kv_heads, capacity, head_dim, store, device)
        self.k_scale = torch.empty(batch, n_kv_heads, capacity, dtype=torch.float32, device=device) if fp8 else None
        self.v_scale = torch.empty_like(self.k_scale) if fp8 else None
        self.pos = torch.empty(capacity, dtype=torch.long, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        """Bytes allocated (capacity, not length)."""
        ts = [self.k, self.v, self.pos] + ([self.k_scale, self.v_scale] if self.fp8 else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.capacity)
        n = self.length

        def grown(t, dim):
            new = _rows_like(t, cap)
            new.narrow(dim, 0, n).copy_(t.narrow(dim, 0, n))
            return new

        self.k, self.v, self.pos = grown(self.k, 2), grown(self.v, 2), grown(self.pos, 0)
        if self.fp8:
            self.k_scale, self.v_scale = grown(self.k_scale, 2), grown(self.v_scale, 2)

    def _put(self, k, v, start: int, end: int) -> None:
        if self.fp8 and use_kv_write_kernel(self.k):  # one launch, no copies of k / v first
            write_kv_block(k, v, start, self.k, self.v, self.k_scale, self.v_scale)
        elif self.fp8:
            k8, ks = quantize_rows(k)
            v8, vs = quantize_rows(v)
            self.k[:, :, start:end], self.k_scale[:, :, start:end] = k8, ks
            self.v[:, :, start:end], self.v_scale[:, :, start:end] = v8, vs
        else:
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v

    @property
    def trimmed(self) -> bool:
        return self.window is not None

    def ring_full(self) -> bool:
        """A single-token write overwrites the oldest row: full, and the rows past the newest window - 1
        are never seen again (capacity >= window)."""
        return self.window is not None and self.length == self.capacity and self.capacity >= self.window

    def next_row(self) -> int:
        """The row the next single-token write takes (host int; GraphDecoder hands it to write_slot)."""
        return self.head if self.ring_full() else self.length

    def wrote_one(self) -> None:
        """Record a single-token write at next_row() (write_slot leaves this to its caller)."""
        if self.ring_full():
            self.head = (self.head + 1) % self.capacity
        else:
            self.length += 1
            self.head = self.length % self.capacity

    def keep_window(self) -> None:
        """Trimmed: move the last window - 1 rows (in position order) to the front; the rest are free. A
        no-op when they are there already, and for a cache that keeps every key."""
        if self.window is None:
            return
        keep = min(self.window - 1, self.length)
        start = (self.head - keep) % self.capacity if self.capacity else 0
        if keep and start:
            idx = (torch.arange(keep, device=self.pos.device) + start) % self.capacity
            ts = [(self.k, 2), (self.v, 2), (self.pos, 0)]
            if self.fp8:
                ts += [(self.k_scale, 2), (self.v_scale, 2)]
            for t, dim in ts:
                src = t.view(torch.uint8) if t.dtype == FP8_DTYPE else t  # index_select takes no e4m3
                src.narrow(dim, 0, keep).copy_(src.index_select(dim, idx))
        self.length = self.head = keep

    def keep_from(self, start: int, window: int) -> None:
        """Keep only the held keys at positions >= start (in stored order), in new tensors of exactly that
        many rows: the rest is freed. The layer is then trimmed (`window`): what a context cache entry's
        local layer keeps once its prefill ended (KVCache.compact_local)."""
        n = self.length
        keep = torch.nonzero(self.pos[:n] >= start).flatten()
        kept = keep.numel()
        ts = {"k": 2, "v": 2, "pos": 0} | ({"k_scale": 2, "v_scale": 2} if self.fp8 else {})
        if kept < self.capacity:
            for name, dim in ts.items():
                t = getattr(self, name)
                src = t.view(torch.uint8) if t.dtype == FP8_DTYPE else t  # index_select takes no e4m3
                setattr(self, name, _rows_like(src, kept).copy_(src.index_select(dim, keep)).view(t.dtype))
        self.window, self.length = window, kept
        self.head = kept % self.capacity if self.capacity else 0

    def store(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store new entries (k, v [B, Hkv, n, D] in the compute dtype, pos [n])."""
        n = k.shape[2]
        if self.window is not None:
            if n == 1 and self.ring_full():  # overwrite the oldest row
                self._write_row(k, v, pos, self.head)
                self.wrote_one()
                return
            if n > 1 or self.length == self.capacity:
                self.keep_window()
        end = self.length + n
        if end > self.capacity:
            self._grow(end)
        if n == 1 and pos.device == self.pos.device and use_kv_write_kernel(self.k):  # eager decode: one launch
            write_kv_slot(k, v, pos, self.length, self.k, self.v, self.pos, self.k_scale, self.v_scale)
        else:
            self._put(k, v, self.length, end)
            self.pos[self.length : end] = pos
        self.length = end
        self.head = end % self.capacity

    def _write_row(self, k, v, pos, row: int) -> None:
        if pos.device == self.pos.device and use_kv_write_kernel(self.k):
            write_kv_slot(k, v, pos, row, self.k, self.v, self.pos, self.k_scale, self.v_scale)
        else:
            self._put(k, v, row, row + 1)
            self.pos[row : row + 1] = pos

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        """Store new entries; return everything held for attention: (k, v, positions) in the compute
        dtype (FP8: the held entries dequantized, the new ones as given). Trimmed, with nothing held: the
        block is handed back as given and only its last window - 1 rows are kept."""
        if self.window is not None and self.length == 0:
            t = min(k.shape[2], self.window - 1)
            if t:
                self.store(k[:, :, k.shape[2] - t :], v[:, :, k.shape[2] - t :], pos[pos.shape[0] - t :])
            return k, v, pos
        self.keep_window()
        held = self.length
        self.store(k, v, pos)
        if not self.fp8:
            return self.view()
        if held == 0:
            return k, v, self.pos[: self.length]
        old_k, old_v, _ = self._dequantized(held)
        return torch.cat([old_k, k], 2), torch.cat([old_v, v], 2), self.pos[: self.length]

    def append_stored(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> StoredKV:
        """Store new entries; return the entries held before them, as stored (no copy). The caller
        attends these plus its own k, v as given (trimmed: the last window - 1 held)."""
        self.keep_window()
        held = self.length
        self.store(k, v, pos)
        return self.stored(held)

    def write_slot(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write one token's entry at the device index `slot` [1] (a captured CUDA-graph step: nothing
        read on the host; the caller takes the row from next_row() and then calls wrote_one()). CUDA: one
        Triton launch (kernels/kv_write.py)."""
        write = write_kv_slot if use_kv_write_kernel(self.k) else write_kv_slot_reference
        write(k, v, pos, slot, self.k, self.v, self.pos, self.k_scale, self.v_scale)

    def _dequantized(self, n: int):
        return (dequantize(self.k[:, :, :n], self.k_scale[:, :, :n], self.dtype),
                dequantize(self.v[:, :, :n], self.v_scale[:, :, :n], self.dtype), self.pos[:n])

    def view(self):
        """Everything held as (k, v, positions) in the compute dtype (an FP8 cache: dequantized copies)."""
        n = self.length
        if self.fp8:
            return self._dequantized(n)
        return self.k[:, :, :n], self.v[:, :, :n], self.pos[:n]

    def stored(self, n: int | None = None) -> StoredKV:
        """The first n entries (default: all held) as stored, no copy: what attention reads directly."""
        n = self.length if n is None else n
        if not self.fp8:
            return StoredKV(self.k[:, :, :n], self.v[:, :, :n], self.pos[:n])
        return StoredKV(self.k[:, :, :n], self.v[:, :, :n], self.pos[:n], self.k_scale[:, :, :n], self.v_scale[:, :, :n])


class KVCache:
    """KV for the layers this rank holds (a pipeline stage holds a slice, keyed by global index)."""

    def __init__(self, layer_ids, batch, n_kv_heads, head_dim, capacity, dtype, device, fp8: bool = False,
                 windows: dict[int, int] | None = None, step: int = 1):
        """windows: {layer: window} of the local layers to trim (module docstring), each allocated
        min(capacity, window - 1 + step) rows, `step` being the most rows one forward stores
        (planner.py trimmed_step); every other layer keeps `capacity` rows and every key."""
        windows = windows or {}
        self.layers = {i: LayerKV(batch, n_kv_heads, head_dim,
                                  capacity if i not in windows else min(capacity, windows[i] - 1 + step),
                                  dtype, device, fp8, windows.get(i)) for i in layer_ids}
        self.device = torch.device(device)
        self.next_position = 0  # position the next token of the sequence takes

    def layer(self, i: int) -> LayerKV:
        return self.layers[i]

    def advance(self, positions: torch.Tensor, end: int | None = None) -> None:
        """Record that `positions` were processed; `end` (max + 1), when known, avoids a device sync."""
        if end is None and positions.numel():
            end = int(positions.max()) + 1
        if end is not None:
            self.next_position = max(self.next_position, end)

    def compact_local(self, windows: dict[int, int], start: int) -> None:
        """A finished prefill whose continuations all begin at or after position `start`: each local layer
        i of `windows` ({layer: window}) keeps only the keys such a continuation can see, positions >=
        start - (window - 1) (a CP shard: those of its rows, possibly none), freeing the rest
        (LayerKV.keep_from). Such a cache serves no prefix of itself shorter than `start` tokens
        (serving/context_cache.py served_prefix)."""
        for i, w in windows.items():
            if i in self.layers and start - (w - 1) > 0:
                self.layers[i].keep_from(start - (w - 1), w)

    @property
    def trimmed(self) -> bool:
        """Some local layer keeps only its window: not the whole sequence (refuse to read it whole)."""
        return any(kv.trimmed for kv in self.layers.values())

    @property
    def length(self) -> int:
        """Rows held by a layer that keeps every key (a trimmed cache's local layers hold fewer)."""
        full = [kv for kv in self.layers.values() if not kv.trimmed] or list(self.layers.values())
        return full[0].length if full else 0
