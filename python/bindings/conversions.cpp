// Between Python and the library: dicts and lists of tensors in (the caller's tensors, no
// copy) and out, Jacobian blocks, shapes, and devices as strings.

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <neml2/dispatch.hpp>

#include "bindings.hpp"

namespace neml2::python {

std::string type_name(py::handle value) {
  return py::str(py::type::of(value).attr("__name__"));
}

at::Tensor to_tensor(py::handle value, const std::string& where) {
  if (!THPVariable_Check(value.ptr()))
    throw FatalError(where + " is a " + type_name(value) + "; it must be a torch.Tensor");
  return THPVariable_Unpack(value.ptr());
}

namespace {
// A dict's str key as UTF-8; a FatalError for one UTF-8 cannot encode (a lone surrogate).
std::string key_text(py::handle key, const char* what) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(key.ptr(), &size);
  if (!data) {
    PyErr_Clear();
    throw FatalError(std::string(what) + " has a key, " + py::repr(key).cast<std::string>() +
                     ", that is not valid text (a lone surrogate UTF-8 cannot encode); keys "
                     "are variable names");
  }
  return {data, static_cast<std::size_t>(size)};
}
} // namespace

// A dict of tensors keyed by name, as the library's map: the same tensors, no copy.
TensorMap to_map(py::handle value, const char* what) {
  TensorMap map;
  if (value.is_none())
    return map;
  if (!PyDict_Check(value.ptr()))
    throw FatalError(std::string(what) + " is a " + type_name(value) +
                     "; it must be a dict of torch.Tensor keyed by variable name");
  for (const auto& [key, tensor] : py::reinterpret_borrow<py::dict>(value)) {
    if (!PyUnicode_Check(key.ptr()))
      throw FatalError(std::string(what) + " has a key of type " + type_name(key) +
                       "; keys are variable names (str)");
    auto name = key_text(key, what);
    auto t = to_tensor(tensor, std::string(what) + "['" + name + "']");
    map.emplace(std::move(name), std::move(t));
  }
  return map;
}

// A dict of dicts of tensors (Jacobian blocks J[out][in]).
VariablePairJacobian to_blocks(py::handle value, const char* what) {
  VariablePairJacobian blocks;
  if (value.is_none())
    return blocks;
  if (!PyDict_Check(value.ptr()))
    throw FatalError(std::string(what) + " is a " + type_name(value) +
                     "; it must be a dict of dicts of torch.Tensor (J[output][input])");
  for (const auto& [key, inner] : py::reinterpret_borrow<py::dict>(value)) {
    if (!PyUnicode_Check(key.ptr()))
      throw FatalError(std::string(what) + " has a key of type " + type_name(key) +
                       "; keys are output names (str)");
    const auto name = key_text(key, what);
    const auto where = std::string(what) + "['" + name + "']";
    blocks.emplace(name, to_map(inner, where.c_str()));
  }
  return blocks;
}

std::vector<at::Tensor> to_list(py::handle value, const char* what) {
  if (!PyList_Check(value.ptr()) && !PyTuple_Check(value.ptr()))
    throw FatalError(std::string(what) + " is a " + type_name(value) +
                     "; it must be a list of torch.Tensor, in the prepared call's order");
  std::vector<at::Tensor> tensors;
  std::size_t k = 0;
  for (const auto& item : py::reinterpret_borrow<py::sequence>(value))
    tensors.push_back(to_tensor(item, std::string(what) + "[" + std::to_string(k++) + "]"));
  return tensors;
}

namespace {
// `add(name, value)` for the names of `map` in `order` first, then the others by name.
template <class Map, class Add>
void in_order(const Map& map, const std::vector<std::string>& order, Add&& add) {
  for (const auto& name : order)
    if (const auto it = map.find(name); it != map.end())
      add(name, it->second);
  for (const auto& [name, value] : map)
    if (std::find(order.begin(), order.end(), name) == order.end())
      add(name, value);
}
} // namespace

py::dict to_dict(const TensorMap& map, const std::vector<std::string>& order) {
  py::dict dict;
  in_order(map, order,
           [&](const std::string& name, const at::Tensor& t) { dict[py::str(name)] = t; });
  return dict;
}

py::dict to_dict(const VariablePairJacobian& blocks, const std::vector<std::string>& outer,
                 const std::vector<std::string>& inner) {
  py::dict dict;
  in_order(blocks, outer, [&](const std::string& name, const TensorMap& row) {
    dict[py::str(name)] = to_dict(row, inner);
  });
  return dict;
}

py::list to_py_list(const std::vector<at::Tensor>& tensors) {
  py::list list;
  for (const auto& t : tensors)
    list.append(t);
  return list;
}

py::list to_py_list(const std::vector<Shape>& shapes) {
  py::list list;
  for (const auto& s : shapes)
    list.append(py::cast(std::vector<std::int64_t>(s.begin(), s.end())));
  return list;
}

std::vector<std::string> device_strings(const std::vector<Device>& devices) {
  std::vector<std::string> out;
  for (const auto& d : devices)
    out.push_back(d.str());
  return out;
}


} // namespace neml2::python
