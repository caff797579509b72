// SwapSpace: named extents ("rank0/group3/exp_avg" -> file, offset, bytes) in swap files that
// are preallocated under one or more directories, read and written through an IoEngine, and
// checksummed per block.
//
// Layout. At open, each directory gets one swap file of capacity_bytes / dirs (rounded up to a
// block), preallocated with fallocate and opened with O_DIRECT. An extent is cut into units of
// block_bytes; with several directories the units go round-robin over them (RAID-0 striping,
// starting at a different directory for each extent so small extents spread too). A
// directory's units of one extent lie end to end in its file, so an op moves each directory's
// share in few engine requests (one per round of D * chunk units, see op_requests()), each
// reading into or writing from every D-th block of the caller's memory. Offsets and lengths on
// disk are multiples of 4 KiB.
//
// Checksums. Every block (block_bytes, the last one of an extent possibly shorter, rounded up
// to 4 KiB) has an xxh3-64 checksum (libxxhash), computed from the caller's memory when the
// write is submitted and kept in memory in this object (one 8-byte word and one state byte
// per block, allocated by create()); nothing is stored on disk, so a swap space lives as long
// as the process, which is what an optimizer swap needs. wait() on a read verifies every block
// it read and returns Status::corruption naming the key, the byte offset in the extent and the
// file offset of the first bad block.
//
// Open-time checks. A directory that does not exist, is not writable, whose filesystem refuses
// O_DIRECT, or that lacks room for its share of capacity_bytes fails open() with a Status that
// names the path (not_found, io_error, unsupported, no_space), not a later write.
//
// Thread-safety: every method may be called from any thread. Reads and writes of disjoint
// blocks may run concurrently; a read and a write of the same block, or two writes, must be
// ordered by the caller (wait for one before submitting the other).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "io/io_engine.hpp"
#include "zinf/status.hpp"

namespace zinf {

struct SwapOptions {
  // Directories, one swap file each (put each on its own drive to stripe across drives).
  std::vector<std::string> dirs = {};
  // Total bytes for extents, split evenly over dirs, preallocated at open.
  std::uint64_t capacity_bytes = 0;
  // Checksum block and stripe unit. A multiple of 4096. Reads and writes of part of an extent
  // start on a block boundary and cover whole blocks (or run to the end of the extent).
  std::size_t block_bytes = std::size_t{1} << 20;
  // Extents that may be created (the table is allocated at open).
  std::uint32_t max_extents = 4096;
  // Reads and writes that may be in flight (submitted, not yet waited for) at once.
  std::uint32_t max_ops = 256;
  // The largest single read or write, which bounds the engine tickets an op may need (one per
  // block at worst, when its blocks were last written to alternate generations of the files).
  std::uint64_t max_op_bytes = std::uint64_t{1} << 30;
  // Swap file name inside each directory; "{pid}" is replaced by the process id.
  std::string file_name = "zinf-swap-{pid}.bin";
  // Delete the swap files when the SwapSpace is destroyed.
  bool remove_files = true;
};

struct ExtentId {
  std::uint32_t index = UINT32_MAX;
  bool valid() const { return index != UINT32_MAX; }
};

struct ExtentInfo {
  std::string key;
  std::uint64_t bytes = 0;       // as created
  std::uint64_t disk_bytes = 0;  // rounded up to 4 KiB
  std::uint32_t block_count = 0;
};

// What SwapSpace::verify() read back.
struct SwapVerifyReport {
  std::uint64_t extents = 0;         // extents with at least one block verified
  std::uint64_t blocks = 0;          // blocks read back, each matching its checksum
  std::uint64_t bytes = 0;           // their bytes
  std::uint64_t skipped_blocks = 0;  // never written, being written, or lost: nothing to check
};

struct SwapTicket {
  std::uint32_t slot = 0;
  std::uint32_t generation = 0;
  bool valid() const { return generation != 0; }
};

// Whether `a` and `b` name one directory (the same device and inode: "/nvme", "/nvme/" and a
// symlink to it do); when either cannot be stat'ed, whether the strings are equal.
bool same_directory(const std::string& a, const std::string& b);
// `dirs` with every directory that same_directory() finds earlier in the list left out: the
// first spelling of each stays, in order.
std::vector<std::string> unique_directories(const std::vector<std::string>& dirs);

class SwapSpace {
 public:
  // Creates and preallocates the swap files through `engine`, which must outlive this object.
  // Errors: invalid_argument when two entries of options.dirs name one directory (the same
  // string, or two spellings of it: same_directory()), naming both; the open-time checks' errors
  // (see the file comment).
  static Result<std::unique_ptr<SwapSpace>> open(IoEngine& engine, const SwapOptions& options);
  // Waits (bounded) for ops still in flight, closes and (remove_files) deletes the files.
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Reserves `bytes` (> 0) for `key`. Errors: invalid_argument when the key exists or is empty,
  // no_space when the capacity is used up (message names the key and the directories),
  // resource_exhausted beyond max_extents.
  Result<ExtentId> create(std::string_view key, std::uint64_t bytes);
  // not_found naming the key. Allocates nothing when the key exists, so a caller may look
  // extents up by key on the step path (keeping the ExtentId is cheaper still).
  Result<ExtentId> find(std::string_view key) const;
  // REQUIRES: id came from create() / find().
  const ExtentInfo& info(ExtentId id) const;

  // Writes [offset, offset + bytes) of the extent from `src`, checksumming it first.
  // REQUIRES: offset a multiple of block_bytes; bytes a multiple of block_bytes or reaching
  // the end of the extent; src 4096-aligned and readable for bytes rounded up to 4096 (the
  // padding is written and checksummed as it is). Errors: invalid_argument (range), and the
  // engine's submit errors, each naming the key.
  Result<SwapTicket> write(ExtentId id, std::uint64_t offset, std::uint64_t bytes, const void* src);
  // Reads the same kind of range into `dst` (writable for bytes rounded up to 4096). Errors:
  // failed_precondition when a block in the range was never written, io_error when its last
  // write failed (its content on disk is unknown).
  Result<SwapTicket> read(ExtentId id, std::uint64_t offset, std::uint64_t bytes, void* dst);
  // Whole-extent shorthands.
  Result<SwapTicket> write(ExtentId id, const void* src) {
    return write(id, 0, info(id).bytes, src);
  }
  Result<SwapTicket> read(ExtentId id, void* dst) { return read(id, 0, info(id).bytes, dst); }

  // True once every engine request of the op finished; wait() then returns without blocking
  // on I/O (it still verifies checksums).
  bool poll(SwapTicket ticket) const;
  // Waits for the op and redeems the ticket. For a read, verifies every block: corruption
  // names key, extent offset and file. Engine errors come back with the key prepended. On
  // timeout returns Status::timeout and the ticket stays unredeemed (wait again).
  Status wait(SwapTicket ticket, std::chrono::milliseconds timeout);

  // Asks the engine to cancel the op's requests still in flight (IoEngine::cancel), typically
  // after wait() timed out on it. Does not redeem the ticket: wait() on it again; a cancelled
  // write fails and its blocks are lost (read() then refuses them), as any failed write.
  // REQUIRES: `ticket` came from read() / write() and was not yet redeemed.
  void cancel(SwapTicket ticket);
  // Gives up on an op that a cancel did not end either (the device holds it): the ticket is
  // released without waiting, a write's blocks are marked lost, and the op's table entry stays
  // taken (one fewer for max_ops) until this object is destroyed, which does not wait for it.
  // The op's memory may still be written by the device at any time: the caller must never
  // reuse it while the engine is open. REQUIRES: as cancel().
  void abandon(SwapTicket ticket);

  // write() / read() and wait(), with the ticket always redeemed on return: past `timeout` the
  // op is cancelled and waited for once more (kTimeout either way); one the cancel does not end
  // either is abandon()ed (kTimeout saying so; a write's blocks are lost). After an abandoned
  // read the device may still write into `dst`.
  Status write_sync(ExtentId id, const void* src,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60));
  Status read_sync(ExtentId id, void* dst,
                   std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // Bytes [offset, offset + bytes) of the extent, as read(id, offset, bytes, dst).
  Status read_sync(ExtentId id, std::uint64_t offset, std::uint64_t bytes, void* dst,
                   std::chrono::milliseconds timeout = std::chrono::seconds(60));

  // Reads back every block whose last write completed, one block at a time, and checks it
  // against the checksum kept when it was written: the corruption of wait() for the first bad
  // block (naming key, extent offset and file), or the I/O error. Blocks never written, lost
  // or being written are skipped and counted.
  // REQUIRES: no write is submitted while it runs.
  Result<SwapVerifyReport> verify(std::chrono::milliseconds timeout = std::chrono::seconds(60));

  // Hard-links each directory's swap file as dest_paths[i] (one per directory, in options().dirs
  // order), after an fdatasync, so the bytes every completed write put there are what the link
  // names, at no copy. The files are then frozen: the next write starts a new generation of each
  // (the swap path is unlinked and created again, preallocated), and writes go only there; a
  // block not rewritten since is read from the frozen file, which is closed once it holds no
  // block this space still reads. So nothing written after this call reaches what dest_paths
  // name. `later_names[i]` names frozen file i in later messages (a checksum mismatch of a block
  // read from it). Errors: failed_precondition while a write is in flight, or with ESTALE when a
  // swap path no longer names this space's file (another space of this process and rank took the
  // name: nothing is linked); resource_exhausted when too many earlier generations are still read;
  // fdatasync's; link(2)'s with its errno (EXDEV when a destination is on another filesystem), no
  // link left behind.
  Status link_files(const std::vector<std::string>& dest_paths,
                    const std::vector<std::string>& later_names);
  // Makes `path` (a file laid out as this space's swap file, such as one link_files() named) the
  // home of the extents' values, at their own offsets, with `checksums` (every block of the
  // extents, in order) as their last writes' checksums: nothing is read or copied. The file is
  // opened read-only as one more generation, never written (the extents' next writes go to the
  // current file), and closed once every block of it was rewritten; a read of it verifies each
  // block as any read does, and a mismatch names `name`. Errors: resource_exhausted when too
  // many generations are open; open's errors; corruption when the file is shorter than the
  // extents' end. REQUIRES: one directory; no write of the extents in flight.
  Status adopt_file(const std::string& path, const std::string& name,
                    const std::vector<ExtentId>& extents,
                    const std::vector<std::uint64_t>& checksums);
  // Forgets the extent's content: its blocks read as never written until written again, and a
  // frozen file that held only them among what this space still reads is closed. REQUIRES: no
  // op on the extent is in flight.
  void discard(ExtentId id);
  // discard(), and the extent's room in the swap files given back to the filesystem (a hole,
  // FALLOC_FL_PUNCH_HOLE), so an extent whose content is known by other means (zeros) takes no
  // disk blocks. The file then reads zeros there; a later write of the extent takes room again
  // (and fails with the filesystem's ENOSPC where the disk filled up in between). While the
  // current files are frozen by link_files() they are left alone; each new generation gets the
  // holes of the extents released and not written since. The hole and the discard happen under
  // one lock, so no write or new generation comes between them. Errors: unsupported (the
  // filesystem cannot punch holes) and fallocate's others, naming the key and the directory. With
  // several directories they are punched in order, and a hole cannot be filled back: when one
  // fails after an earlier directory gave its part back, that part reads zeros, so its blocks are
  // marked lost (read() answers io_error for them until the extent is written again), the rest
  // keep their content, and the message names the directories whose room was given back;
  // otherwise nothing is given back and nothing discarded. REQUIRES: no op on the extent is in
  // flight.
  Status release(ExtentId id);
  // Whether every block of the extent was written, its last write completed, and it lies in the
  // files the next link_files() would link (no write since a link, no block left in a frozen file).
  bool in_current_file(ExtentId id) const;
  // With one directory: where the extent starts in the swap file (its blocks follow each other).
  // REQUIRES: options().dirs.size() == 1.
  std::uint64_t file_offset(ExtentId id) const;
  // The xxh3-64 of block `block` (block_bytes, the last one rounded up to 4 KiB) as last written.
  // REQUIRES: the block's last write completed.
  std::uint64_t block_checksum(ExtentId id, std::uint32_t block) const;

  // The engine requests a read or write of `bytes` from an extent's start takes when its blocks
  // lie in one generation of the files (no link_files() came between their writes): 1 with one
  // directory; with D directories, one per directory and round of D * chunk blocks (fewer in a
  // last round of fewer than D blocks), where a chunk is what keeps D requests within the
  // engine's queue_depth pieces (at least one block). Each request stays
  // submitted until the op is waited for, so ops in flight times this is what they hold of the
  // engine's IoOptions::max_requests.
  std::uint32_t op_requests(std::uint64_t bytes) const;
  IoEngine& engine() const;

  const SwapOptions& options() const;
  // The swap files, one per directory, in options().dirs order.
  std::vector<std::string> file_paths() const;
  std::uint64_t used_bytes() const;  // bytes reserved by create(), summed over dirs

  struct Impl;

 private:
  explicit SwapSpace(std::unique_ptr<Impl> impl);
  Status finish_sync(SwapTicket ticket, std::chrono::milliseconds timeout);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zinf
