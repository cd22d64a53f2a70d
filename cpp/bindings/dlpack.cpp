#include "dlpack.h"

#include <string>

namespace py = pybind11;

namespace pyengine::bindings {
namespace {

DType to_dtype(const dlpack::DataType& t, const std::string& name) {
  if (t.lanes == 1) {
    if (t.code == 2 && t.bits == 32) return DType::kFloat32;
    if (t.code == 2 && t.bits == 16) return DType::kFloat16;
    if (t.code == 4 && t.bits == 16) return DType::kBFloat16;
    if (t.code == 0 && t.bits == 32) return DType::kInt32;
    if (t.code == 0 && t.bits == 64) return DType::kInt64;
    if (t.code == 0 && t.bits == 8) return DType::kInt8;
    if (t.code == 1 && t.bits == 8) return DType::kUInt8;
    if (t.code == 10 && t.bits == 8) return DType::kFloat8E4M3;  // kDLFloat8_e4m3fn
  }
  throw py::type_error(name + " has an unsupported dtype (DLPack code " + std::to_string(t.code) +
                       ", " + std::to_string(t.bits) + " bits, " + std::to_string(t.lanes) +
                       " lanes); supported: float32, float16, bfloat16, int32, int64, int8, uint8, float8_e4m3fn");
}

Device to_device(const dlpack::Device& d, const std::string& name) {
  switch (d.device_type) {
    case 1:
    case 3: return {DeviceKind::kCPU, 0};
    case 2: return {DeviceKind::kCUDA, d.device_id};
    default:
      throw py::type_error(name + " is on an unsupported device (DLPack device type " +
                           std::to_string(d.device_type) + "); supported: cpu, cuda");
  }
}

// obj's DLPack capsule. torch.Tensor.__dlpack__ is Python, several times slower than
// torch's C entry point, and a layer calls a kernel with 7 tensors. Torch is used only if
// something already imported it.
py::object dlpack_capsule(const py::handle& obj) {
  static PyObject* tensor_type = nullptr;  // strong references, kept for the process
  static PyObject* to_dlpack = nullptr;
  if (tensor_type == nullptr) {
    const py::object torch = py::module_::import("sys").attr("modules").attr("get")("torch");
    if (!torch.is_none() && py::hasattr(torch, "Tensor") && py::hasattr(torch, "_C") &&
        py::hasattr(torch.attr("_C"), "_to_dlpack")) {
      tensor_type = py::object(torch.attr("Tensor")).release().ptr();
      to_dlpack = py::object(torch.attr("_C").attr("_to_dlpack")).release().ptr();
    }
  }
  if (tensor_type != nullptr && PyObject_IsInstance(obj.ptr(), tensor_type) == 1) {
    PyObject* capsule = PyObject_CallOneArg(to_dlpack, obj.ptr());
    if (capsule == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(capsule);
  }
  return obj.attr("__dlpack__")();
}

}  // namespace

DLPackView::DLPackView(const py::handle& obj, const std::string& name) {
  if (!py::hasattr(obj, "__dlpack__")) {
    throw py::type_error(name +
                         " must be a tensor that supports DLPack (torch.Tensor, "
                         "numpy.ndarray, ...), got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  capsule_ = dlpack_capsule(obj);
  // The capsule keeps the name "dltensor": its destructor then calls the producer's
  // deleter when capsule_ goes, after the kernel is done with the memory.
  auto* managed =
      static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule_.ptr(), "dltensor"));
  if (managed == nullptr) throw py::error_already_set();
  const dlpack::Tensor& t = managed->dl_tensor;
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims) {
    throw py::value_error(name + " has " + std::to_string(t.ndim) + " dims; at most " +
                          std::to_string(TensorView::kMaxDims) + " are supported");
  }
  view_.data = static_cast<char*>(t.data) + t.byte_offset;
  view_.dtype = to_dtype(t.dtype, name);
  view_.device = to_device(t.device, name);
  view_.ndim = t.ndim;
  int64_t dense_stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    const auto i = static_cast<size_t>(d);
    view_.shape[i] = t.shape[d];
    view_.strides[i] = t.strides != nullptr ? t.strides[d] : dense_stride;
    dense_stride *= t.shape[d];
  }
}

}  // namespace pyengine::bindings
