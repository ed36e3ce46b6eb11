"""transformers' Qwen3.5 text model run in float64 end to end.

`model.double()` alone leaves float32 inside: the RMSNorms call `x.float()`, the gated norm, the chunked
delta rule and the rotary embedding cast to `torch.float32`/`torch.float` explicitly, so a double model's
rows are only float32-accurate (up to ~1e-6 relative on unit-scale tiny models). Inside `float64()` those
casts give float64: the module's `torch` answers float64 for `float32`/`float`, and `Tensor.float` is
`Tensor.double`. What remains in float32 is the rotary inverse frequencies, built in float32 when the model
is constructed (a ~1e-9 relative effect on the rows). The model's own code runs unchanged otherwise.
"""

import contextlib
import types

import torch


class _Torch64(types.ModuleType):
    def __getattr__(self, name):
        if name in ("float32", "float"):
            return torch.float64
        return getattr(torch, name)


@contextlib.contextmanager
def float64():
    """Run transformers' Qwen3.5 modules (a `.double()` model) with their float32 casts made float64."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    saved_torch, saved_float = hf.torch, torch.Tensor.float
    hf.torch, torch.Tensor.float = _Torch64("torch"), torch.Tensor.double
    try:
        yield
    finally:
        hf.torch, torch.Tensor.float = saved_torch, saved_float


def rows(model, ids):
    """last_hidden_state [L, hidden] float64 of a `.double()` Qwen3_5TextModel for one prompt's ids."""
    with torch.no_grad(), float64():
        return model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], use_cache=False).last_hidden_state[0]
