"""Philox-4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3") in Python
integers, for tests that check the kernels' dropout draws against the generator's definition."""

MASK32 = 0xFFFFFFFF


def philox4x32_10(key: int, counter: tuple[int, int, int, int]) -> list[int]:
    """The four 32-bit outputs for a 64-bit ``key`` and a four-word ``counter``."""
    k0, k1 = key & MASK32, (key >> 32) & MASK32
    c0, c1, c2, c3 = counter
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return [c0, c1, c2, c3]


def sixteen_bit_draws(key: int, counter: tuple[int, int, int, int]) -> list[int]:
    """The eight 16-bit draws of one call as the kernels split them: draw ``j`` is half ``j % 2``
    (low, then high) of output ``j // 2``."""
    words = philox4x32_10(key, counter)
    return [(words[j // 2] >> (16 * (j % 2))) & 0xFFFF for j in range(8)]
