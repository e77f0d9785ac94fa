"""A stream no one else is handed, for the measured choice's trial timers on an
accelerator (src/measured/trial_timer.h).

A timer's end is recorded on a stream that first waits for the timed call's end. On
CUDA, torch's "new stream" (``torch.cuda.Stream()``, and ``getNewStream`` in C++) is one
of a pool of 32 handed round robin to every caller, the program's streams too: a wait
there would hold back whatever the program later runs on the same pool stream. So the
stream is made by the driver (``cuStreamCreate``, non-blocking: a blocking stream would
also order itself with the legacy default stream, where most programs run), once per
device and process, and kept for the process's life, as torch keeps its pool's.

Another accelerator (a PrivateUse1 device) registers its own maker with ``register``;
a device with none cannot time its trial calls, and its classes keep the program's
own way, saying why.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

# cuda.h: CU_STREAM_NON_BLOCKING, and the versioned names the header maps the
# context calls to.
_NON_BLOCKING = 0x1
_DRIVER = "libcuda.so.1"

Maker = Callable[[int], int]
_makers: dict[str, Maker] = {}
_made: dict[tuple[str, int], int] = {}
_lock = threading.Lock()


def register(device_type: str, maker: Maker) -> None:
    """``maker(index)`` makes a stream of its own on device ``index`` of ``device_type``
    (as torch names it: "cuda", or a PrivateUse1 backend's name) and returns its id as
    c10 packs it."""
    with _lock:
        _makers[device_type] = maker


def own_stream(device_type: str, index: int) -> int:
    """The stream id of this process's own stream on ``device_type:index``, made at the
    first call; raises (naming the device) where none can be made."""
    key = (device_type, index)
    with _lock:
        if key in _made:
            return _made[key]
        maker = _makers.get(device_type)
        if maker is None:
            raise RuntimeError(f"fairring_pg knows no way to make a stream on {device_type}")
        _made[key] = maker(index)
        return _made[key]


def _checked(driver: ctypes.CDLL, name: str, *args: object) -> None:
    result = getattr(driver, name)(*args)
    if result != 0:
        raise RuntimeError(f"the CUDA driver's {name} failed with CUresult {result}")


def _cuda_stream(index: int, driver: ctypes.CDLL | None = None) -> int:
    """A non-blocking stream of the driver's on CUDA device ``index``, made in its
    primary context (the one torch's runtime uses); its handle is the stream's id, as
    ``torch.cuda.ExternalStream`` packs it."""
    driver = driver or ctypes.CDLL(_DRIVER)
    device = ctypes.c_int()
    _checked(driver, "cuDeviceGet", ctypes.byref(device), ctypes.c_int(index))
    context = ctypes.c_void_p()
    _checked(driver, "cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    _checked(driver, "cuCtxPushCurrent_v2", context)
    try:
        stream = ctypes.c_void_p()
        _checked(driver, "cuStreamCreate", ctypes.byref(stream), ctypes.c_uint(_NON_BLOCKING))
    finally:
        _checked(driver, "cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))
    if not stream.value:
        raise RuntimeError("the CUDA driver's cuStreamCreate returned no stream")
    return int(stream.value)


register("cuda", _cuda_stream)
