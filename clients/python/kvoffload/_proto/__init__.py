"""The generated kvoffload.v1 stubs (scripts/protogen-python.sh), behind a
check of the protobuf runtime they are loaded into.

The stubs are protoc 3.21 gencode (``internal.builder``, no runtime version
check of their own): protobuf runtimes from 4.21 (protoc 3.21's Python
release) up to the 6.x line load them. Older runtimes lack the builder; a
runtime of a later major may drop such gencode. Either way the import fails
here, naming the fix, instead of deep inside the stubs.
"""

PROTOBUF_REQUIREMENT = "protobuf>=4.21,<7"
_OLDEST = (4, 21)
_NEXT_MAJOR = 7


def _version(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _check_runtime() -> None:
    fix = f"install a supported runtime: pip install '{PROTOBUF_REQUIREMENT}'"
    try:
        import google.protobuf as protobuf
    except ImportError as e:
        raise ImportError(f"kvoffload needs the protobuf package ({PROTOBUF_REQUIREMENT}); {fix}") from e
    found = str(getattr(protobuf, "__version__", "unknown"))
    v = _version(found)
    if v < _OLDEST or v[0] >= _NEXT_MAJOR:
        raise ImportError(f"kvoffload's generated protobuf code needs {PROTOBUF_REQUIREMENT}, and this environment "
                          f"has protobuf {found}; {fix}")
    try:
        from .kvoffload.v1 import kvoffload_pb2  # noqa: F401
    except (ImportError, TypeError, AttributeError) as e:
        raise ImportError(f"kvoffload's generated protobuf code does not load with protobuf {found} ({e}); "
                          f"{fix}") from e


_check_runtime()
