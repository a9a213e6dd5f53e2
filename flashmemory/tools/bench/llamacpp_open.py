"""Opening llama.cpp (llama-cpp-python) the way this machine allows: on a CPU with Intel AMX,
llama.cpp built with GGML_NATIVE=ON repacks weights for AMX tiles in its "extra buffer types"
and segfaults inside llama_decode (every model, llama-cpp-python 0.3.x), so there the model is
loaded with use_extra_bufts = False. FLASHMEMORY_LLAMACPP_EXTRA_BUFTS=on|off overrides the
choice; every bench report records it with the CPU."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from flashmemory import cpu_features
from flashmemory.errors import ConfigError

EXTRA_BUFTS_ENV = "FLASHMEMORY_LLAMACPP_EXTRA_BUFTS"
_CHOICES = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class LoadChoice:
    """Whether llama.cpp keeps its extra buffer types (weights repacked for the CPU's matrix
    units), and why."""

    extra_buffer_types: bool
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_choice() -> LoadChoice:
    value = os.environ.get(EXTRA_BUFTS_ENV, "auto").strip().lower()
    if value not in _CHOICES:
        raise ConfigError(f"{EXTRA_BUFTS_ENV}={value!r} is not one of {', '.join(_CHOICES)}; "
                          "unset it to let the bench choose by the CPU (off where it has AMX)")
    forced = _CHOICES[value]
    if forced is not None:
        return LoadChoice(forced, f"{EXTRA_BUFTS_ENV}={value}")
    if cpu_features.has_amx():
        return LoadChoice(False, "this CPU has AMX (amx_tile): llama.cpp's AMX weight repack "
                                 "segfaults in llama_decode, so its extra buffer types are off")
    return LoadChoice(True, "llama.cpp's default (no AMX on this CPU)")


@contextmanager
def _model_params(llama_cpp: Any, extra_buffer_types: bool):
    """llama-cpp-python's Llama() takes no use_extra_bufts argument: the default model
    parameters it starts from (its llama_cpp.llama_cpp binding's, looked up at each load) are
    given the field for the load's duration."""
    native = getattr(llama_cpp, "llama_cpp", llama_cpp)
    default = native.llama_model_default_params
    if extra_buffer_types:
        yield
        return

    def without_extra_bufts():
        params = default()
        if not hasattr(params, "use_extra_bufts"):
            raise ConfigError("this llama-cpp-python has no use_extra_bufts model parameter, so "
                              "its AMX repack cannot be turned off; install a newer one (bash "
                              f"scripts/install_llama_cpp.sh) or set {EXTRA_BUFTS_ENV}=on to try "
                              "it as is")
        params.use_extra_bufts = False
        return params

    native.llama_model_default_params = without_extra_bufts
    try:
        yield
    finally:
        native.llama_model_default_params = default


def open_llama(**kwargs: Any):
    """llama_cpp.Llama(**kwargs), loaded as load_choice() says."""
    import llama_cpp

    with _model_params(llama_cpp, load_choice().extra_buffer_types):
        return llama_cpp.Llama(**kwargs)


def machine_record() -> dict[str, Any]:
    """What a report says of the machine for llama.cpp's rows: the CPU, the buffer types."""
    return {"cpu": cpu_features.describe(), "llamacpp_load": load_choice().as_dict()}
