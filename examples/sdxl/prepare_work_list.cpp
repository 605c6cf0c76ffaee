#include "prepare_work_list.hpp"

#include <algorithm>

#include "prepare_images.hpp"
#include "zero/core/error.hpp"

namespace sdxl::prepare {

namespace fs = std::filesystem;

std::vector<ImageEntry> list_images(const fs::path& root) {
  std::error_code error;
  ZERO_CHECK(fs::is_directory(root, error), "--images '", root.string(), "' is not a folder");
  std::vector<ImageEntry> entries;
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied);
       it != fs::recursive_directory_iterator(); ++it) {
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {  // hidden files and folders
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file()) continue;
    const auto kind = sdxl::prepare::classify_file(it->path());
    if (kind == sdxl::prepare::FileKind::other) continue;
    entries.push_back({fs::relative(it->path(), root).generic_string(), it->path(),
                       kind == sdxl::prepare::FileKind::image});
  }
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.relative < b.relative; });
  return entries;
}

Json input_identity(const ImageEntry& e) {
  auto stamp = [](const fs::path& p) -> Json {
    std::error_code error;
    const auto size = fs::file_size(p, error);
    if (error) return nullptr;
    const auto time = fs::last_write_time(p, error).time_since_epoch().count();
    return Json::array({size, static_cast<long long>(time)});
  };
  fs::path caption = e.path;
  caption.replace_extension(".txt");
  return Json::array({e.relative, stamp(e.path), stamp(caption)});
}

ShardRange shard_range(std::size_t shard, std::size_t shard_size, std::size_t total) {
  return {shard * shard_size, std::min(total, (shard + 1) * shard_size)};
}

}  // namespace sdxl::prepare
