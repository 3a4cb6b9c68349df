"""The numerics-relevant global settings of a run, so bisect can say which ones differ."""
from __future__ import annotations

import os
import platform
import sys

import torch


def _safe(fn, default=None):
    try:
        return fn()
    except Exception:  # a backend missing from this build is not an error
        return default


def numerics_settings() -> dict:
    """A flat dict of every setting that can change the bits a kernel produces."""
    cuda = torch.backends.cuda
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": _safe(lambda: cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": _safe(lambda: torch.backends.cudnn.allow_tf32),
        "cudnn_deterministic": _safe(lambda: torch.backends.cudnn.deterministic),
        "cudnn_benchmark": _safe(lambda: torch.backends.cudnn.benchmark),
        "allow_fp16_reduced_precision_reduction": _safe(lambda: cuda.matmul.allow_fp16_reduced_precision_reduction),
        "allow_bf16_reduced_precision_reduction": _safe(lambda: cuda.matmul.allow_bf16_reduced_precision_reduction),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": _safe(torch.get_num_interop_threads),
        "sdp_flash": _safe(cuda.flash_sdp_enabled),
        "sdp_mem_efficient": _safe(cuda.mem_efficient_sdp_enabled),
        "sdp_math": _safe(cuda.math_sdp_enabled),
        "sdp_cudnn": _safe(cuda.cudnn_sdp_enabled),
        "mkldnn_enabled": _safe(lambda: torch.backends.mkldnn.enabled),
        "default_dtype": str(torch.get_default_dtype()),
        **inductor_settings(),
        **grad_mode(),
    }


# torch.compile (Inductor) configs that change the bits compiled code produces: trace key -> (config attribute,
# its default as torch/_inductor/config.py computes it). Importing that config costs seconds, so where nothing
# imported it yet (nothing was compiled) the defaults are read the way it would read them.
INDUCTOR_KEYS = {
    "inductor_emulate_precision_casts": ("emulate_precision_casts",
                                         lambda: os.environ.get("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "0") == "1"),
    "inductor_fallback_random": ("fallback_random", lambda: False),
    "inductor_max_autotune": ("max_autotune", lambda: os.environ.get("TORCHINDUCTOR_MAX_AUTOTUNE") == "1"),
    "inductor_coordinate_descent_tuning": ("coordinate_descent_tuning",
                                           lambda: os.environ.get("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING") == "1"),
    "inductor_cpp_simdlen": ("cpp.simdlen", lambda: None),
    "inductor_triton_cudagraphs": ("triton.cudagraphs", lambda: os.environ.get("TORCHINDUCTOR_CUDAGRAPHS") == "1"),
}


def inductor_settings(options: dict | None = None) -> dict:
    """The INDUCTOR_KEYS values in effect: Inductor's global config, overridden by `options` (what
    torch.compile(..., mode=, options=) gave one compiled model, keyed like Inductor's config: "cpp.simdlen")."""
    cfg = sys.modules.get("torch._inductor.config")
    out = {}
    for key, (attr, default) in INDUCTOR_KEYS.items():
        if options and attr in options:
            out[key] = options[attr]
            continue
        if cfg is None:
            out[key] = _safe(default)
            continue
        obj = cfg
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        out[key] = obj
    return out


def grad_mode() -> dict:
    """Autograd's mode: grad_enabled (False under torch.no_grad) and inference_mode (torch.inference_mode). A
    forward under autograd records extra ops (aten.detach), and some kernels pick another path when an input
    requires grad; a trace taken under no_grad against one taken with grad shows fewer tensors compared, so
    bisect lists these keys when they differ."""
    return {"grad_enabled": torch.is_grad_enabled(), "inference_mode": torch.is_inference_mode_enabled()}


def note_grad_mode(settings: dict, first: bool) -> None:
    """Called at each call of the recorded model (its root module): the grad mode the forward really ran under,
    not the one at `record(...)`'s entry (`with divtrace.record(m, p): with torch.no_grad(): m(x)` is common).
    The first root call sets the keys; a later one under another mode makes that key "mixed"."""
    for k, v in grad_mode().items():
        if first:
            settings[k] = v
        elif settings.get(k) != v:
            settings[k] = "mixed"


def run_environment(device: str) -> dict:
    env = {"torch_version": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["cuda_device_name"] = _safe(lambda: torch.cuda.get_device_name(torch.device(device)))
        env["cuda_version"] = torch.version.cuda
    return env


def settings_diff(a: dict, b: dict) -> list[dict]:
    """The settings whose values differ, as [{"name", "a", "b"}]."""
    return [{"name": k, "a": a.get(k), "b": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


# Settings that repro scripts can re-apply per side, and how (name -> python statement template).
APPLICABLE = {
    "float32_matmul_precision": "torch.set_float32_matmul_precision({v!r})",
    "num_threads": "torch.set_num_threads({v!r})",
    "cuda_matmul_allow_tf32": "torch.backends.cuda.matmul.allow_tf32 = {v!r}",
    "cudnn_allow_tf32": "torch.backends.cudnn.allow_tf32 = {v!r}",
    "allow_fp16_reduced_precision_reduction": "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = {v!r}",
    "allow_bf16_reduced_precision_reduction": "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = {v!r}",
}
