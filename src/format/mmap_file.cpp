// format/mmap_file.cpp: POSIX mapping of model files.
#include "format/mmap_file.h"

#include "format/page_in.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kiln {

Expected<std::shared_ptr<const MappedFile>> MappedFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::errorf("cannot open '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return Status::errorf("cannot stat '{}': {}", path, std::strerror(e));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    return Status::errorf("'{}' is a directory, not a file", path);
  }
  if (st.st_size <= 0) {
    ::close(fd);
    return Status::errorf("'{}' is empty (0 bytes)", path);
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  int e = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (p == MAP_FAILED) return Status::errorf("cannot map '{}': {}", path, std::strerror(e));
  auto* mf = new MappedFile();
  mf->data_ = static_cast<const std::byte*>(p);
  mf->size_ = static_cast<uint64_t>(st.st_size);
  mf->mapped_ = true;
  mf->name_ = path;
  return std::shared_ptr<const MappedFile>(mf);
}

std::shared_ptr<const MappedFile> MappedFile::from_bytes(std::vector<std::byte> bytes,
                                                         std::string name) {
  auto* mf = new MappedFile();
  mf->owned_ = std::move(bytes);
  mf->data_ = mf->owned_.data();
  mf->size_ = mf->owned_.size();
  mf->name_ = std::move(name);
  return std::shared_ptr<const MappedFile>(mf);
}

Status MappedFile::lock_in_ram() const { return kiln::lock_in_ram(*this); }

MappedFile::~MappedFile() {
  if (mapped_) ::munmap(const_cast<std::byte*>(data_), size_);
}

uint64_t page_size() {
  static const uint64_t ps = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return ps;
}

}  // namespace kiln
