#include "backend/python_callback.h"

#include <Python.h>
#include <frameobject.h>

namespace fairring {

namespace {

// torch._C.Future, looked up once (borrowed for the life of the interpreter:
// the module keeps it).
PyObject* futureType() {
  static PyObject* type = []() -> PyObject* {
    PyObject* module = PyImport_ImportModule("torch._C");
    if (module == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    PyObject* t = PyObject_GetAttrString(module, "Future");
    Py_DECREF(module);
    if (t == nullptr) {
      PyErr_Clear();
    }
    return t;
  }();
  return type;
}

// Whether one of `frame`'s positional arguments is a torch Future.
bool hasFutureArgument(PyFrameObject* frame, PyObject* type) {
  PyCodeObject* code = PyFrame_GetCode(frame);
  const int nargs = code->co_argcount;
  bool found = false;
  if (nargs > 0) {
    PyObject* names = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_varnames");
    // The attribute, not PyFrame_GetLocals (Python 3.11+): this builds on 3.10.
    PyObject* locals = PyObject_GetAttrString(reinterpret_cast<PyObject*>(frame), "f_locals");
    if (names != nullptr && locals != nullptr && PyTuple_Check(names)) {
      for (int i = 0; i < nargs && i < PyTuple_GET_SIZE(names) && !found; ++i) {
        PyObject* value = PyObject_GetItem(locals, PyTuple_GET_ITEM(names, i));
        if (value == nullptr) {
          PyErr_Clear(); // deleted or not yet bound
          continue;
        }
        found = PyObject_IsInstance(value, type) == 1;
        Py_DECREF(value);
      }
    }
    Py_XDECREF(names);
    Py_XDECREF(locals);
    PyErr_Clear();
  }
  Py_DECREF(code);
  return found;
}

} // namespace

bool insidePythonFutureCallback() {
  if (!Py_IsInitialized()) {
    return false;
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  bool found = false;
  if (PyObject* type = futureType()) {
    PyFrameObject* frame = PyEval_GetFrame(); // borrowed
    Py_XINCREF(frame);
    while (frame != nullptr && !found) {
      found = hasFutureArgument(frame, type);
      PyFrameObject* back = PyFrame_GetBack(frame); // new reference
      Py_DECREF(frame);
      frame = back;
    }
    Py_XDECREF(frame);
  }
  PyGILState_Release(gil);
  return found;
}

} // namespace fairring
