"""Reading a cubin (a little-endian ELF64 image) without a GPU: its sections and the bytes of a global variable."""

from __future__ import annotations

import struct

_SHT_SYMTAB = 2
_SHT_NOBITS = 8  # a section that occupies no bytes in the image (zero-initialised data)
_SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, align, entsize
_SYMBOL = struct.Struct("<IBBHQQ")  # name, info, other, section index, value, size


class CubinError(ValueError):
    """The image is not a cubin this reader understands, or lacks what was asked for."""


def _sections(image: bytes) -> list[tuple[int, int, int, int, int]]:
    """(name offset, type, file offset, size, link) of every section header."""
    if image[:4] != b"\x7fELF" or len(image) < 64 or image[4] != 2 or image[5] != 1:
        raise CubinError("not a little-endian ELF64 image (a cubin)")
    (table_offset,) = struct.unpack_from("<Q", image, 0x28)
    entry_size, count, _ = struct.unpack_from("<HHH", image, 0x3A)
    headers = []
    for index in range(count):
        name, kind, _flags, _addr, offset, size, link, *_ = _SECTION_HEADER.unpack_from(
            image, table_offset + index * entry_size)
        headers.append((name, kind, offset, size, link))
    return headers


def _string(table: bytes, offset: int) -> str:
    return table[offset : table.index(b"\0", offset)].decode()


def sections(image: bytes) -> dict[str, bytes]:
    """Section name -> contents (empty for sections that hold no bytes in the image)."""
    headers = _sections(image)
    (shstrndx,) = struct.unpack_from("<H", image, 0x3E)
    _, _, names_offset, names_size, _ = headers[shstrndx]
    names = image[names_offset : names_offset + names_size]
    return {_string(names, name): b"" if kind == _SHT_NOBITS else image[offset : offset + size]
            for name, kind, offset, size, _ in headers}


def variable_bytes(image: bytes, symbol: str) -> bytes:
    """The initial bytes of the global variable ``symbol`` (a mangled name) from the cubin's symbol table."""
    headers = _sections(image)
    for _, kind, offset, size, link in headers:
        if kind != _SHT_SYMTAB:
            continue
        _, _, strings_offset, strings_size, _ = headers[link]
        strings = image[strings_offset : strings_offset + strings_size]
        for start in range(offset, offset + size, _SYMBOL.size):
            name, _info, _other, section, value, length = _SYMBOL.unpack_from(image, start)
            if _string(strings, name) != symbol:
                continue
            if not 0 < section < len(headers):
                raise CubinError(f"symbol {symbol} is not defined in a section of the cubin")
            _, data_kind, data_offset, data_size, _ = headers[section]
            if data_kind == _SHT_NOBITS:
                return bytes(length)
            if value + length > data_size:
                raise CubinError(f"symbol {symbol} ({length} bytes at {value}) lies outside its section")
            return image[data_offset + value : data_offset + value + length]
    raise CubinError(f"the cubin has no symbol {symbol}")
