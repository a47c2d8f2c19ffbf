// Helpers the tools' tests share.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"

namespace tuna::testing_util {

// Every tensor of every safetensors file in `dir`, as fp32, by "file:tensor".
inline std::map<std::string, std::vector<float>> safetensors_tensors(const std::filesystem::path& dir) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().extension() != ".safetensors") continue;
    const SafetensorsFile file(f.path());
    for (const TensorInfo& t : file.tensors()) {
      std::vector<float>& v = out[f.path().filename().string() + ":" + t.name];
      v.resize(t.numel);
      file.read_f32(t.name, t.shape, v.data());
    }
  }
  return out;
}

}  // namespace tuna::testing_util
