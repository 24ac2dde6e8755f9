"""Which symbol versions (GLIBC_2.34, GLIBCXX_3.4.30, ...) an ELF shared object needs.

Stdlib only and loaded by file path (the cache-wheel backend tags its wheel with it); reads the
dynamic symbol table and the GNU version sections of a little-endian ELF64 file directly.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

SHT_DYNSYM, SHT_GNU_VERNEED, SHT_GNU_VERSYM = 11, 0x6FFFFFFE, 0x6FFFFFFF

# manylinux_2_28 (the policy auditwheel applies): newest versions a wheel may need from the
# system's libstdc++ / libgcc_s, besides glibc itself.
MANYLINUX_2_28_LIMITS = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11),
                         "GCC": (7, 0, 0)}


@dataclass(frozen=True)
class Need:
    """One undefined symbol bound to a versioned library: `symbol@version` from `library`."""

    symbol: str
    version: str
    library: str

    @property
    def family(self) -> str:
        return self.version.rsplit("_", 1)[0]

    @property
    def number(self) -> tuple[int, ...]:
        m = re.fullmatch(r"[A-Z]+_([0-9.]+)", self.version)
        return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def _cstr(blob: bytes, offset: int) -> str:
    return blob[offset:blob.index(b"\0", offset)].decode()


def _sections(data: bytes) -> list[tuple[int, int, int, int]]:
    """(type, offset, size, link) of every section of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    out = []
    for i in range(shnum):
        _, kind, _, _, off, size, link = struct.unpack_from("<IIQQQQI", data, shoff + i * shentsize)
        out.append((kind, off, size, link))
    return out


def _verneed(data: bytes, sec, strtab: bytes) -> dict[int, tuple[str, str]]:
    """Version index -> (version name, library) from .gnu.version_r."""
    out, pos, end = {}, sec[1], sec[1] + sec[2]
    while pos < end:
        _, cnt, file_off, aux, nxt = struct.unpack_from("<HHIII", data, pos)
        library, apos = _cstr(strtab, file_off), pos + aux
        for _ in range(cnt):
            _, _, other, name, anext = struct.unpack_from("<IHHII", data, apos)
            out[other] = (_cstr(strtab, name), library)
            apos += anext
        if not nxt:
            break
        pos += nxt
    return out


def needed_versions(path: Path) -> list[Need]:
    """Every undefined dynamic symbol that needs a specific library version."""
    data = Path(path).read_bytes()
    sections = _sections(data)
    by_type = {kind: (kind, off, size, link) for kind, off, size, link in sections}
    if SHT_GNU_VERNEED not in by_type or SHT_DYNSYM not in by_type:
        return []
    vn = by_type[SHT_GNU_VERNEED]
    vn_strtab = sections[vn[3]]
    versions = _verneed(data, vn, data[vn_strtab[1]:vn_strtab[1] + vn_strtab[2]])
    dynsym, versym = by_type[SHT_DYNSYM], by_type.get(SHT_GNU_VERSYM)
    sym_strtab = sections[dynsym[3]]
    names = data[sym_strtab[1]:sym_strtab[1] + sym_strtab[2]]
    needs = []
    for i in range(dynsym[2] // 24):
        name_off, _, _, shndx = struct.unpack_from("<IBBH", data, dynsym[1] + i * 24)
        index = struct.unpack_from("<H", data, versym[1] + 2 * i)[0] & 0x7FFF if versym else 0
        if shndx == 0 and index in versions:
            version, library = versions[index]
            needs.append(Need(_cstr(names, name_off), version, library))
    return needs


def too_new(needs: list[Need], limits: dict[str, tuple[int, ...]] = MANYLINUX_2_28_LIMITS
            ) -> list[Need]:
    """The needs above `limits` (families without a limit, e.g. a private library, pass)."""
    return [n for n in needs if n.family in limits and n.number > limits[n.family]]


def newest_glibc(needs: list[Need]) -> tuple[int, int]:
    """The newest GLIBC_2.N among the needs (2.17 when none)."""
    return max([n.number[:2] for n in needs if n.family == "GLIBC"] + [(2, 17)])
