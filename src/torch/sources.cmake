# zero::torch: the LibTorch adapter, a library of its own so that zero::zero
# never depends on torch.
add_library(zero_torch ${PROJECT_SOURCE_DIR}/src/torch/sharded_model.cpp)
add_library(zero::torch ALIAS zero_torch)
target_link_libraries(zero_torch PUBLIC zero::zero ${TORCH_LIBRARIES})
target_compile_features(zero_torch PUBLIC cxx_std_20)
set_target_properties(zero_torch PROPERTIES EXPORT_NAME torch)
list(APPEND ZERO_EXTRA_INSTALL_TARGETS zero_torch)
