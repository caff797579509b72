// A small ext4 filesystem on a loop device, for tests of real storage faults: a disk that fills
// up, a filesystem the kernel turns read-only. ok() is false, with reason(), where the machine
// does not allow it (not root, no mkfs.ext4, no loop devices); the test then skips naming it.
//
// The filesystem is mounted with errors=remount-ro, and turn_read_only() reports an error to
// ext4 through /sys/fs/ext4/<device>/trigger_fs_error, which makes the kernel remount it read-only
// at once, open files and all, as it does on a real metadata error. (A plain `mount -o
// remount,ro` is refused with EBUSY while a file is open for writing, which a swap file always
// is.) Reads keep working; every write and every new file fails with EROFS.
#pragma once

#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace zinf::test_common {

class LoopMount {
 public:
  // An image of `mib` MiB under $ZINF_TEST_TMPDIR (or /tmp), formatted and mounted.
  LoopMount(const std::string& name, int mib) {
    const char* root = std::getenv("ZINF_TEST_TMPDIR");
    const std::string base = root != nullptr && root[0] != '\0' ? root : "/tmp";
    std::filesystem::create_directories(base);
    stem_ = base + "/loop-" + name + "-" + std::to_string(::getpid());
    image_ = stem_ + ".img";
    dir_ = stem_ + ".mnt";
    if (::geteuid() != 0) {
      reason_ = "mounting a loop filesystem needs root";
      return;
    }
    std::filesystem::create_directories(dir_);
    if (!run("truncate -s " + std::to_string(mib) + "M " + image_) ||
        !run("mkfs.ext4 -q -F -m 0 " + image_)) {
      reason_ = "cannot make an ext4 image (" + last_ + ")";
      return;
    }
    if (!run("mount -o loop,errors=remount-ro " + image_ + " " + dir_)) {
      reason_ = "cannot mount a loop device here (" + last_ + ")";
      return;
    }
    mounted_ = true;
    std::ifstream mounts("/proc/mounts");
    std::string source, target, rest;
    while (mounts >> source >> target && std::getline(mounts, rest)) {
      if (target == dir_) device_ = source.substr(source.rfind('/') + 1);
    }
  }
  ~LoopMount() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
    std::error_code ignored;
    std::filesystem::remove(image_, ignored);
    std::filesystem::remove_all(dir_, ignored);
  }
  LoopMount(const LoopMount&) = delete;
  LoopMount& operator=(const LoopMount&) = delete;

  bool ok() const { return mounted_ && !device_.empty(); }
  const std::string& reason() const { return reason_; }
  const std::string& path() const { return dir_; }
  const std::string& device() const { return device_; }

  // Takes every free block with a filler file (fallocate in halving sizes down to one block,
  // then writes of single blocks) until the filesystem says ENOSPC; returns the bytes taken.
  std::uint64_t fill(const std::string& name = "filler") {
    const int fd = ::open((dir_ + "/" + name).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return 0;
    std::uint64_t total = 0;
    for (off_t chunk = off_t{1} << 26; chunk >= 4096; chunk /= 2) {
      while (::fallocate(fd, 0, static_cast<off_t>(total), chunk) == 0) {
        total += static_cast<std::uint64_t>(chunk);
      }
    }
    std::vector<char> block(4096, 'f');
    while (::pwrite(fd, block.data(), block.size(), static_cast<off_t>(total)) ==
           static_cast<ssize_t>(block.size())) {
      total += block.size();
      if (::fsync(fd) != 0) break;
    }
    ::fsync(fd);
    ::close(fd);
    return total;
  }

  // Makes the kernel remount the filesystem read-only (see the file comment). False when
  // the kernel lacks trigger_fs_error.
  bool turn_read_only() {
    std::ofstream trigger("/sys/fs/ext4/" + device_ + "/trigger_fs_error");
    if (!trigger) return false;
    trigger << "zinf test: turning the filesystem read-only";
    trigger.close();
    // The kernel acts from a work queue (and newer kernels mark the filesystem emergency_ro
    // inside ext4, which access(2) does not see): wait until creating a file fails, at most 2 s.
    const std::string probe = dir_ + "/.read-only-probe";
    for (int i = 0; i < 200; ++i) {
      const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT, 0644);
      if (fd < 0 && errno == EROFS) return true;
      if (fd >= 0) {
        ::close(fd);
        ::unlink(probe.c_str());
      }
      ::usleep(10'000);
    }
    return false;
  }

 private:
  bool run(const std::string& command) {
    const std::string quiet = command + " 2>" + stem_ + ".err";
    const int rc = std::system(quiet.c_str());
    std::ifstream err(stem_ + ".err");
    std::getline(err, last_);
    std::error_code ignored;
    std::filesystem::remove(stem_ + ".err", ignored);
    if (rc != 0 && last_.empty()) last_ = "exit status " + std::to_string(rc);
    return rc == 0;
  }

  std::string stem_, image_, dir_, device_, reason_, last_;
  bool mounted_ = false;
};

}  // namespace zinf::test_common
