"""The connector's release version and the API protocol it speaks.

``__version__`` is the project's (the VERSION file at the repository root;
deploy/version_test.go checks they agree, and pyproject.toml reads it from
here). ``PROTOCOL_VERSION`` is the daemon API's protocol, a number apart from
releases: the client sends it with Register and the daemon refuses a protocol
it does not speak, naming both versions (docs/vllm.md, Versions).
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
