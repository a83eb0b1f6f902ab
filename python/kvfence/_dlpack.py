"""A DLPack producer in ctypes (standard library only): hands a region of
pool memory to torch (torch.from_dlpack), or any DLPack consumer, without
a copy, on the host (kDLCPU) and on CUDA (kDLCUDA) alike.

Each export is a DLManagedTensor whose manager context keeps `owner`
referenced: the consumer calls the deleter when its tensor dies, and a
capsule nobody consumed calls it when the capsule dies. So the memory's
owner lives while any tensor made from it does, and live_exports(owner)
counts those tensors.
"""

import ctypes

KDL_CPU = 1
KDL_CUDA = 2

KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT = 0, 1, 2, 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_NAME = b"dltensor"
# Our own function objects: ctypes.pythonapi's are shared by every module
# of the process, and another's argtypes would change how ours convert.
_api = ctypes.PyDLL(ctypes.pythonapi._name)
_PyCapsule_New = _api.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_PyCapsule_IsValid = _api.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = _api.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

# Live exports: the managed tensor's address -> (struct, shape, strides,
# owner). No lock: the deleter runs inside a consumer's tensor deallocation,
# holding the GIL, where waiting for a lock another thread holds (and
# needs the GIL to release) would deadlock; single dict operations are
# atomic under the GIL.
_live = {}


def _delete(mt):
    _live.pop(ctypes.addressof(mt.contents), None)  # drops the owner's reference


_deleter = _DELETER(_delete)
_DELETER_ADDR = ctypes.cast(_deleter, ctypes.c_void_p).value

_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _capsule_destructor(capsule):
    # A consumer renames the capsule ("used_dltensor") and owns the deleter
    # call; a capsule still named "dltensor" was never consumed.
    if _PyCapsule_IsValid(capsule, _NAME):
        _live.pop(_PyCapsule_GetPointer(capsule, _NAME), None)


_destructor = _CAPSULE_DESTRUCTOR(_capsule_destructor)
_DESTRUCTOR_ADDR = ctypes.cast(_destructor, ctypes.c_void_p).value


def _trampolines():
    """The deleter and capsule destructor to hand out: the library's C
    trampolines (ABI 7), which call ours with the interpreter's lock held
    and a pending exception saved around them, or, with an older library,
    ours directly. A consumer may drop its tensor while an exception
    propagates (a frame unwinding frees its locals): a ctypes callback
    entered then sees that exception pending, fails, and leaves the
    interpreter's state corrupt (SystemError, then a crash)."""
    from . import _lib
    if _lib.py_set_callbacks is None:
        return _deleter, _DESTRUCTOR_ADDR
    addr = lambda name: ctypes.cast(getattr(_api, name), ctypes.c_void_p).value
    api = _lib.PyAPI(addr("PyErr_Fetch"), addr("PyErr_Restore"), addr("PyGILState_Ensure"), addr("PyGILState_Release"))
    if _lib.py_set_callbacks(ctypes.byref(api), _DELETER_ADDR, _DESTRUCTOR_ADDR) != 0:
        raise ImportError("kvfence: libkvfence refused the DLPack callbacks")
    return (ctypes.cast(_lib.py_dlpack_deleter, _DELETER),
            ctypes.cast(_lib.py_capsule_destructor, ctypes.c_void_p).value)


_export_deleter, _EXPORT_DESTRUCTOR_ADDR = _trampolines()


def live_exports(owner):
    """How many exports of owner's memory are alive (not yet deleted)."""
    return sum(1 for e in list(_live.values()) if e[3] is owner)


def describe(capsule_owner_addr):
    """The DLTensor of a live export, by its managed tensor's address (tests)."""
    e = _live.get(capsule_owner_addr)
    return None if e is None else e[0].dl_tensor


def capsule(data, device_type, device_id, code, bits, shape, strides, owner):
    """A "dltensor" capsule of shape/strides (in elements) at address data.
    Returns (capsule, address of its DLManagedTensor)."""
    n = len(shape)
    sh = (ctypes.c_int64 * n)(*shape)
    st = (ctypes.c_int64 * n)(*strides)
    mt = DLManagedTensor()
    mt.dl_tensor.data = data
    mt.dl_tensor.device = DLDevice(device_type, device_id)
    mt.dl_tensor.ndim = n
    mt.dl_tensor.dtype = DLDataType(code, bits, 1)
    mt.dl_tensor.shape = sh
    mt.dl_tensor.strides = st
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = _export_deleter
    addr = ctypes.addressof(mt)
    _live[addr] = (mt, sh, st, owner)
    return _PyCapsule_New(addr, _NAME, _EXPORT_DESTRUCTOR_ADDR), addr
