"""dsv4stream: run DeepSeek-V4-Flash from the official checkpoint with routed experts streamed from disk.

A regular package (not a namespace package): with an editable install, a namespace
package's `__path__` merges every checkout on `sys.path`, and modules then load silently
from another tree.
"""

__version__ = "0.2.0"
