"""XXH3-64 (seed 0, the default secret), the checksum zinf's C++ side writes into a checkpoint's
manifest for each file (lib/base/hash.hpp, libxxhash's XXH3_64bits), so that the Python readers of
a checkpoint check a file as a load does without a dependency beyond numpy.

The algorithm is xxHash 0.8's (https://github.com/Cyan4973/xxHash, xxhash.h: XXH3_64bits and its
scalar code paths), written out below. Inputs over 240 bytes (every client_state.bin) take the
long path: 8 accumulators of 64 bits; for each stripe of 64 bytes and lane i,
    acc[i ^ 1] += data[i];  acc[i] += lo32(data[i] ^ key[i]) * hi32(data[i] ^ key[i]),
with the key read 8 bytes further into the secret at each stripe of a block of 16 stripes, and
after each block
    acc[i] = ((acc[i] ^ (acc[i] >> 47)) ^ secret_tail[i]) * PRIME32_1.
Within a block the additions do not depend on the accumulators, so numpy sums each block's
stripes at once (uint64 arithmetic wraps modulo 2^64, as C's does) and only the scramble runs
block by block.
"""
import os

import numpy as np

_MASK = (1 << 64) - 1
_PRIME32_1 = 0x9E3779B1
_PRIME32_2 = 0x85EBCA77
_PRIME32_3 = 0xC2B2AE3D
_PRIME64_1 = 0x9E3779B185EBCA87
_PRIME64_2 = 0xC2B2AE3D27D4EB4F
_PRIME64_3 = 0x165667B19E3779F9
_PRIME64_4 = 0x85EBCA77C2B2AE63
_PRIME64_5 = 0x27D4EB2F165667C5
_PRIME_MX1 = 0x165667919E3779F9
_PRIME_MX2 = 0x9FB21C651E98DF25

# XXH3_kSecret, the default secret (192 bytes).
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_STRIPE_BYTES = 64
_STRIPES_PER_BLOCK = (len(_SECRET) - _STRIPE_BYTES) // 8  # 16
_BLOCK_BYTES = _STRIPE_BYTES * _STRIPES_PER_BLOCK  # 1024
# The blocks numpy reduces at a time: 8 MiB of input, a few times that in temporaries.
_CHUNK_BLOCKS = 8192


def _read64(data, at: int) -> int:
    return int.from_bytes(data[at:at + 8], "little")


def _read32(data, at: int) -> int:
    return int.from_bytes(data[at:at + 4], "little")


def _mul128_fold64(a: int, b: int) -> int:
    product = a * b
    return (product & _MASK) ^ (product >> 64)


def _xxh64_avalanche(h: int) -> int:
    h ^= h >> 33
    h = (h * _PRIME64_2) & _MASK
    h ^= h >> 29
    h = (h * _PRIME64_3) & _MASK
    return h ^ (h >> 32)


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * _PRIME_MX1) & _MASK
    return h ^ (h >> 32)


def _rotl64(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _rrmxmx(h: int, length: int) -> int:
    h ^= _rotl64(h, 49) ^ _rotl64(h, 24)
    h = (h * _PRIME_MX2) & _MASK
    h ^= (h >> 35) + length
    h = (h * _PRIME_MX2) & _MASK
    return h ^ (h >> 28)


def _mix16(data, at: int, secret_at: int) -> int:
    return _mul128_fold64(_read64(data, at) ^ _read64(_SECRET, secret_at),
                          _read64(data, at + 8) ^ _read64(_SECRET, secret_at + 8))


def _short(data) -> int:
    """XXH3_64bits of at most 240 bytes (XXH3_len_0to16_64b, _17to128, _129to240)."""
    length = len(data)
    s = _SECRET
    if length == 0:
        return _xxh64_avalanche(_read64(s, 56) ^ _read64(s, 64))
    if length <= 3:
        combined = (data[0] << 16) | (data[length >> 1] << 24) | data[length - 1] | (length << 8)
        return _xxh64_avalanche(combined ^ (_read32(s, 0) ^ _read32(s, 4)))
    if length <= 8:
        input64 = _read32(data, length - 4) + (_read32(data, 0) << 32)
        return _rrmxmx(input64 ^ (_read64(s, 8) ^ _read64(s, 16)), length)
    if length <= 16:
        low = _read64(data, 0) ^ (_read64(s, 24) ^ _read64(s, 32))
        high = _read64(data, length - 8) ^ (_read64(s, 40) ^ _read64(s, 48))
        swapped = int.from_bytes(low.to_bytes(8, "little"), "big")
        return _avalanche((length + swapped + high + _mul128_fold64(low, high)) & _MASK)
    acc = length * _PRIME64_1
    if length <= 128:
        if length > 32:
            if length > 64:
                if length > 96:
                    acc += _mix16(data, 48, 96) + _mix16(data, length - 64, 112)
                acc += _mix16(data, 32, 64) + _mix16(data, length - 48, 80)
            acc += _mix16(data, 16, 32) + _mix16(data, length - 32, 48)
        acc += _mix16(data, 0, 0) + _mix16(data, length - 16, 16)
        return _avalanche(acc & _MASK)
    for i in range(8):
        acc += _mix16(data, 16 * i, 16 * i)
    acc = _avalanche(acc & _MASK)
    for i in range(8, length // 16):
        acc += _mix16(data, 16 * i, 16 * (i - 8) + 3)
    acc += _mix16(data, length - 16, 136 - 17)
    return _avalanche(acc & _MASK)


def _accumulate_stripe(acc: list, data, at: int, secret_at: int) -> None:
    """XXH3_accumulate_512_scalar on Python ints: one stripe of `data` from `at`."""
    for i in range(8):
        value = _read64(data, at + 8 * i)
        keyed = value ^ _read64(_SECRET, secret_at + 8 * i)
        acc[i ^ 1] = (acc[i ^ 1] + value) & _MASK
        acc[i] = (acc[i] + (keyed & 0xFFFFFFFF) * (keyed >> 32)) & _MASK


# Lane i of stripe n of a block is keyed with the secret's 64-bit word n + i.
_BLOCK_KEYS = np.array([[_read64(_SECRET, 8 * (n + i)) for i in range(8)]
                        for n in range(_STRIPES_PER_BLOCK)], dtype=np.uint64)
_SCRAMBLE_KEYS = [_read64(_SECRET, len(_SECRET) - _STRIPE_BYTES + 8 * i) for i in range(8)]
_SWAP_LANES = [1, 0, 3, 2, 5, 4, 7, 6]


def _block_sums(blocks: np.ndarray) -> list:
    """What the accumulation of each whole block of `blocks` (uint8, a multiple of 1024 bytes)
    adds to each lane, modulo 2^64: a list of 8-int lists, one per block."""
    data = blocks.view("<u8").reshape(-1, _STRIPES_PER_BLOCK, 8)
    keyed = data ^ _BLOCK_KEYS
    added = (keyed & np.uint64(0xFFFFFFFF)) * (keyed >> np.uint64(32))
    added += data[:, :, _SWAP_LANES]
    return added.sum(axis=1, dtype=np.uint64).tolist()


def _long(data: np.ndarray) -> int:
    """XXH3_hashLong_64b of `data` (uint8, over 240 bytes)."""
    length = data.shape[0]
    acc = [_PRIME32_3, _PRIME64_1, _PRIME64_2, _PRIME64_3, _PRIME64_4, _PRIME32_2, _PRIME64_5,
           _PRIME32_1]
    block_count = (length - 1) // _BLOCK_BYTES
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    k0, k1, k2, k3, k4, k5, k6, k7 = _SCRAMBLE_KEYS
    m, p = _MASK, _PRIME32_1
    for first in range(0, block_count, _CHUNK_BLOCKS):
        last = min(block_count, first + _CHUNK_BLOCKS)
        # The scramble, lane by lane, written out: this loop is most of the time taken.
        for s0, s1, s2, s3, s4, s5, s6, s7 in _block_sums(
                data[first * _BLOCK_BYTES:last * _BLOCK_BYTES]):
            v = (a0 + s0) & m
            a0 = ((v ^ (v >> 47) ^ k0) * p) & m
            v = (a1 + s1) & m
            a1 = ((v ^ (v >> 47) ^ k1) * p) & m
            v = (a2 + s2) & m
            a2 = ((v ^ (v >> 47) ^ k2) * p) & m
            v = (a3 + s3) & m
            a3 = ((v ^ (v >> 47) ^ k3) * p) & m
            v = (a4 + s4) & m
            a4 = ((v ^ (v >> 47) ^ k4) * p) & m
            v = (a5 + s5) & m
            a5 = ((v ^ (v >> 47) ^ k5) * p) & m
            v = (a6 + s6) & m
            a6 = ((v ^ (v >> 47) ^ k6) * p) & m
            v = (a7 + s7) & m
            a7 = ((v ^ (v >> 47) ^ k7) * p) & m
    acc = [a0, a1, a2, a3, a4, a5, a6, a7]
    tail_at = block_count * _BLOCK_BYTES
    tail = bytes(data[tail_at:])
    for n in range((length - 1 - tail_at) // _STRIPE_BYTES):
        _accumulate_stripe(acc, tail, n * _STRIPE_BYTES, 8 * n)
    last_stripe = bytes(data[length - _STRIPE_BYTES:])
    _accumulate_stripe(acc, last_stripe, 0, len(_SECRET) - _STRIPE_BYTES - 7)
    result = length * _PRIME64_1
    for i in range(4):
        result += _mul128_fold64(acc[2 * i] ^ _read64(_SECRET, 11 + 16 * i),
                                 acc[2 * i + 1] ^ _read64(_SECRET, 11 + 16 * i + 8))
    return _avalanche(result & _MASK)


def xxh3_64(data) -> int:
    """XXH3_64bits(data, len(data)) with seed 0: bytes, a bytearray, memoryview or a uint8
    numpy array."""
    if isinstance(data, np.ndarray):
        array = data.reshape(-1).view(np.uint8)
    else:
        array = np.frombuffer(data, dtype=np.uint8)
    if array.shape[0] <= 240:
        return _short(bytes(array))
    return _long(array)


def xxh3_64_file(path: str) -> tuple[int, int]:
    """(size in bytes, XXH3_64bits) of the file at `path`, mapped rather than read whole."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, xxh3_64(b"")
    return size, xxh3_64(np.memmap(path, dtype=np.uint8, mode="r", shape=(size,)))
