// Opening the files a tool reads, where a file is expected: only regular files.
//
// A FIFO given as a shard or a config would block the open (or the read) forever, a device would be read
// without end, a directory or a symlink loop fails deep inside a library with a message about something
// else. These functions refuse each by name before any byte is read, and bound what they read into memory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace tuna {

// Opens `path` read-only (O_CLOEXEC) and returns the descriptor, failing with a tuna::Error that names the
// path and `what` (e.g. "token shard") when it is missing, unreadable, a symlink loop, or not a regular file
// (a directory, FIFO, socket, character or block device, each named). The open does not block on a FIFO.
// *size, when given, receives the file's size.
int open_regular_file(const std::filesystem::path& path, const std::string& what, uint64_t* size = nullptr);

// The whole content of a small regular file (JSON, TOML): as open_regular_file, and refused when it holds
// more than max_bytes (before reading it).
std::string read_regular_file(const std::filesystem::path& path, const std::string& what, uint64_t max_bytes);

// The status of a path that should be an existing directory: fails naming the path when it is missing, a
// symlink loop, unreadable, or something other than a directory.
void require_directory(const std::filesystem::path& path, const std::string& what);

// "a directory", "a FIFO (named pipe)", "a character device", ... for a stat mode.
const char* file_type_name(unsigned mode);

}  // namespace tuna
