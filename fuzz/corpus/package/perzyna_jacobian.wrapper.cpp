                                   const std::string& device_str,
                                   std::optional<std::string> cubin_dir)
    : AOTInductorModelBase(2,
                           2,
                           1,
                           device_str,
                           std::move(cubin_dir),
                           true) {
    inputs_info_[0].name = "arg10_1";
    inputs_info_[1].name = "arg11_1";
    constants_info_[0].name = "constant0";
    constants_info_[0].dtype = cached_torch_dtype_float64;
    constants_info_[0].device_type = cached_torch_device_type_cpu;
    constants_info_[0].offset = 0;
    constants_info_[0].data_size = 64;
    constants_info_[0].from_folded = false;
    constants_info_[0].type = static_cast<int32_t>(torch::aot_inductor::ConstantType::Unknown);
    constants_info_[0].shape = {};
    constants_info_[0].stride = {};
    constants_info_[0].layout = static_cast<int32_t>(cached_torch_layout_strided);
    constants_info_[0].original_fqn = "constant0";
    update_constants_map(std::move(constants_map));
    update_constants_array(std::move(constants_array));
    in_spec_ = R"([1, {"type": "builtins.tuple", "context": "null", "children_spec": [{"type": "builtins.tuple", "context": "null", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}, {"type": "builtins.dict", "context": "[]", "children_spec": []}]}])";
    out_spec_ = R"([1, {"type": "builtins.tuple", "context": "null", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}])";
    outputs_info_[0].name = "output0";
    outputs_info_[1].name = "output1";
    this->kernels_ = std::make_unique<AOTInductorModelKernels>();
}

std::unordered_map<std::string, AtenTensorHandle> AOTInductorModel::const_run_impl(
    DeviceStreamType stream,
    AOTIProxyExecutorHandle proxy_executor,
    bool initialization
) {

    if (!initialization) {
        std::cerr << "[WARNING] Calling constant_folding in model, but compiled with config: "
                  << "aot_inductor.use_runtime_constant_folding=False\n";
    }
    return {};
}
} // namespace torch::aot_inductor
using namespace torch::aot_inductor;
namespace torch::aot_inductor {

void AOTInductorModel::_const_run_impl(
    std::vector<AtenTensorHandle>& output_handles,
    DeviceStreamType stream,
    AOTIProxyExecutorHandle proxy_executor
) {}

AOTI_NOINLINE static void check_input_0(
    AtenTensorHandle* input_handles
) {
    ConstantHandle arg10_1 = ConstantHandle(input_handles[0]);
    int32_t arg10_1_dtype;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(arg10_1, &arg10_1_dtype));

    int32_t arg10_1_expected_dtype = aoti_torch_dtype_float64();
    if (arg10_1_expected_dtype != arg10_1_dtype) {
        std::stringstream ss;
        ss << "input_handles[0]: unmatched dtype, "
           << "expected: " << arg10_1_expected_dtype << "(at::kDouble), "
           << "but got: " << arg10_1_dtype << "\n";
        throw std::runtime_error(ss.str());
    }
    auto arg10_1_size = arg10_1.sizes();

    if (arg10_1_size[0] < 2) {
        std::stringstream ss;
        ss << "input_handles[0]: dim value is too small at 0, "
           << "expected it to be >= 2, " << "but got: "
           << arg10_1_size[0] << "\n";
        throw std::runtime_error(ss.str());
    }

    if (arg10_1_size[0] > 1048576) {
        std::stringstream ss;
        ss << "input_handles[0]: dim value is too large at 0, "
           << "expected to be <= 1048576, " << "but got: "
           << arg10_1_size[0] << "\n";
        throw std::runtime_error(ss.str());
    }

    if (7 != arg10_1_size[1]) {
        std::stringstream ss;
        ss << "input_handles[0]: unmatched dim value at 1, "
           << "expected: 7, " << "but got: " << arg10_1_size[1]
           << "\n";
        throw std::runtime_error(ss.str());
    }
    auto arg10_1_stride = arg10_1.strides();

    if (7 != arg10_1_stride[0]) {
        std::stringstream ss;
        ss << "input_handles[0]: unmatched stride value at 0, "
           << "expected: 7, " << "but got: " << arg10_1_stride[0]
           << "\n";
        throw std::runtime_error(ss.str());
    }

    if (1 != arg10_1_stride[1]) {
        std::stringstream ss;
        ss << "input_handles[0]: unmatched stride value at 1, "
           << "expected: 1, " << "but got: " << arg10_1_stride[1]
           << "\n";
        throw std::runtime_error(ss.str());
    }
    int32_t arg10_1_device_type;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(arg10_1, &arg10_1_device_type));

    int32_t arg10_1_expected_device_type = 0;
    if (arg10_1_expected_device_type != arg10_1_device_type) {
        std::stringstream ss;
        ss << "input_handles[0]: unmatched device type, "
        << "expected: " << arg10_1_expected_device_type << "0(cpu), "
        << "but got: " << arg10_1_device_type << "\n";
        throw std::runtime_error(ss.str());
    }
}

AOTI_NOINLINE static void check_input_1(
    AtenTensorHandle* input_handles
) {
    ConstantHandle arg11_1 = ConstantHandle(input_handles[1]);
    int32_t arg11_1_dtype;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(arg11_1, &arg11_1_dtype));

    int32_t arg11_1_expected_dtype = aoti_torch_dtype_float64();
    if (arg11_1_expected_dtype != arg11_1_dtype) {
        std::stringstream ss;
        ss << "input_handles[1]: unmatched dtype, "
           << "expected: " << arg11_1_expected_dtype << "(at::kDouble), "
           << "but got: " << arg11_1_dtype << "\n";
        throw std::runtime_error(ss.str());
    }
    auto arg11_1_size = arg11_1.sizes();

    if (arg11_1_size[0] < 2) {
        std::stringstream ss;
        ss << "input_handles[1]: dim value is too small at 0, "
           << "expected it to be >= 2, " << "but got: "
           << arg11_1_size[0] << "\n";
        throw std::runtime_error(ss.str());
    }

    if (arg11_1_size[0] > 1048576) {
        std::stringstream ss;
        ss << "input_handles[1]: dim value is too large at 0, "
           << "expected to be <= 1048576, " << "but got: "
           << arg11_1_size[0] << "\n";
        throw std::runtime_error(ss.str());
    }

    if (21 != arg11_1_size[1]) {
        std::stringstream ss;
        ss << "input_handles[1]: unmatched dim value at 1, "
           << "expected: 21, " << "but got: " << arg11_1_size[1]
           << "\n";
        throw std::runtime_error(ss.str());
    }
    auto arg11_1_stride = arg11_1.strides();

    if (21 != arg11_1_stride[0]) {
        std::stringstream ss;
        ss << "input_handles[1]: unmatched stride value at 0, "
           << "expected: 21, " << "but got: " << arg11_1_stride[0]
           << "\n";
        throw std::runtime_error(ss.str());
    }

    if (1 != arg11_1_stride[1]) {
        std::stringstream ss;
        ss << "input_handles[1]: unmatched stride value at 1, "
           << "expected: 1, " << "but got: " << arg11_1_stride[1]
           << "\n";
        throw std::runtime_error(ss.str());
    }
    int32_t arg11_1_device_type;
    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(arg11_1, &arg11_1_device_type));

    int32_t arg11_1_expected_device_type = 0;
    if (arg11_1_expected_device_type != arg11_1_device_type) {
        std::stringstream ss;
        ss << "input_handles[1]: unmatched device type, "
        << "expected: " << arg11_1_expected_device_type << "0(cpu), "
        << "but got: " << arg11_1_device_type << "\n";
        throw std::runtime_error(ss.str());
    }
}

