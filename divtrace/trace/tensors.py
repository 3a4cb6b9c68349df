"""Where a value's bytes are read: `Trace.tensor(vid)` loads a stored tensor from its safetensors shard and
checks it bit-exactly against its recorded fingerprint; a view value of a full-mode trace stored as "rebuild
from the op" (divtrace.trace.derived_views) is rebuilt from its input's bytes (`_rebuilt`). torch is imported here only, when
bytes are really asked for."""
from __future__ import annotations

from divtrace.errors import DivtraceError
from divtrace.trace.records import TensorValue
from divtrace.trace.fields import _SHARD_NAME, torch_dtype
from divtrace.trace.meta import _hasher


class TensorAccess:
    """Value access of Trace (a mixin: the state is Trace's)."""

    def has_bytes(self, vid: int) -> bool:
        """Whether the trace can give `vid`'s bytes: stored, or (full mode) rebuilt from a view op."""
        if vid not in self.vkey:
            raise KeyError(vid)
        return vid in self.vblob or (self._full and vid in self.vderived)

    def real_key(self, vid: int) -> tuple:
        """`vkey[vid]`, with the real fingerprint of the bytes where the recorded one is derived from a view op
        (full mode; the bytes are rebuilt once and the key kept)."""
        if vid not in self.vderived or not self._full:
            return self.vkey[vid]
        key = self._real_keys.get(vid)
        if key is None:
            dtype, shape, _ = self.vkey[vid]
            key = self._real_keys[vid] = (dtype, shape, self._hash(self.tensor(vid)))
        return key

    def _hash(self, t) -> str:
        """The fingerprint function of this trace's hash_scheme (imports torch on first use)."""
        h = self.__dict__.get("_hash_fn")
        if h is None:
            h = self._hash_fn = _hasher(self.meta["hash_scheme"])
        return h(t)

    def tensor(self, vid: int):
        """The recorded value (a torch.Tensor), loaded lazily and checked bit-exactly against its fingerprint."""
        import torch

        v = self.values[vid]
        if v.derived and self._full:
            return self._rebuilt(vid, v)
        if v.blob is None:
            raise DivtraceError(f"{self.path}: value {vid} has no stored bytes (trace recorded with mode='hash')")
        where = self.path / v.shard
        shard = self._open_shard(v.shard, vid)
        try:
            flat = shard.get_tensor(v.blob)
        except Exception:
            raise DivtraceError(f"{where}: tensor {v.blob} missing or unreadable") from None
        dtype = torch_dtype(v.dtype)
        if flat.dtype == torch.uint8 and dtype != torch.uint8 and flat.dim() == 1 \
                and flat.numel() == v.numel * dtype.itemsize:
            flat = flat.view(dtype)  # a dtype safetensors cannot hold, stored as raw bytes
        if flat.dtype != dtype or flat.numel() != v.numel or flat.dim() != 1:
            raise DivtraceError(f"{where}: tensor {v.blob} has dtype/size {flat.dtype}/{flat.numel()}, "
                                f"the record says {v.dtype}/{v.numel}")
        t = flat.reshape(v.shape)
        if self._hash(t) != v.hash:
            raise DivtraceError(f"{where}: tensor {v.blob} is corrupt (bytes do not match the recorded "
                                "fingerprint)")
        return t

    def derived_problem(self, vid: int) -> str | None:
        """Why the derived-view value `vid` cannot be rebuilt from its producing op, or None: the op must be a
        view divtrace derives, with one input, and the recorded fingerprint must be the one derived from them."""
        from divtrace.trace.derived_views import DERIVABLE_VIEWS, rebuildable, view_fingerprint

        v = self.values[vid]
        rec = self.records[v.producer]
        where = f"{self.path}: value {vid} (derived from record {v.producer}, {rec.op})"
        if rec.op not in DERIVABLE_VIEWS or not rebuildable(rec.args, rec.kwargs) or len(set(rec.inputs)) != 1:
            return f"{where}: not a view divtrace rebuilds"
        src = self.values[rec.inputs[0]]
        if view_fingerprint(rec.op, src.hash, src.dtype, src.shape, v.shape, rec.args, rec.kwargs) != v.hash:
            return f"{where}: corrupt (its fingerprint is not the one derived from the op and its input)"
        return None

    def _rebuilt(self, vid: int, v: TensorValue):
        """A view value of a full-mode trace, rebuilt by applying its recorded view op to the input's bytes (and
        a view of a view from the first stored value up, in a loop: chains can be long)."""
        from divtrace.trace.derived_views import rebuild_view

        chain = [vid]
        while self.values[chain[-1]].derived:
            problem = self.derived_problem(chain[-1])
            if problem:
                raise DivtraceError(problem)
            chain.append(self.records[self.values[chain[-1]].producer].inputs[0])
            if len(chain) > len(self.vderived) + 1:
                raise DivtraceError(f"{self.path}: value {vid}: its views form a cycle (edited by hand?)")
        t = self.tensor(chain.pop())
        for link in reversed(chain):
            lv = self.values[link]
            rec = self.records[lv.producer]
            try:
                t = rebuild_view(rec.op, rec.args, rec.kwargs, t)
            except (RuntimeError, ValueError, IndexError, TypeError) as e:
                raise DivtraceError(f"{self.path}: value {link}: cannot rebuild it with {rec.op} "
                                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
            if torch_dtype(lv.dtype) != t.dtype or list(t.shape) != lv.shape:
                raise DivtraceError(f"{self.path}: value {link}: {rec.op} rebuilt dtype/shape {t.dtype}/"
                                    f"{list(t.shape)}, the record says {lv.dtype}/{lv.shape}")
        return t

    def _open_shard(self, name, vid):
        if name not in self._shards:
            from safetensors import safe_open

            p = self.path / str(name)
            if not isinstance(name, str) or _SHARD_NAME.match(name) is None or not p.is_file():
                raise DivtraceError(f"{self.path}: value {vid} points to missing shard {name!r}")
            try:
                self._shards[name] = safe_open(str(p), framework="pt")
            except Exception as e:
                raise DivtraceError(f"{p}: truncated or corrupt safetensors shard ({type(e).__name__})") from None
        return self._shards[name]
