# Checkpoint folders, above the engine and io: the manifest, verification,
# rotation, and consolidation of the engine's shard files into full tensors.
target_sources(zero PRIVATE
  ${PROJECT_SOURCE_DIR}/src/checkpoint/checkpoint.cpp
  ${PROJECT_SOURCE_DIR}/src/checkpoint/consolidate.cpp)
