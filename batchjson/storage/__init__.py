"""Where a run's files live, how they are committed and how the folder is locked.

folder.py (layout, names, commit protocol, fingerprints) · locks.py (flock, leases) · location.py (local path or
object-storage URI).
"""

from batchjson.storage.folder import STAGED, STATE, Kind, Storage, hidden_below
from batchjson.storage.location import Location, Unreadable, glob_match, is_uri
from batchjson.storage.locks import Lease

__all__ = ["STAGED", "STATE", "Kind", "Lease", "Location", "Storage", "Unreadable", "glob_match",
           "hidden_below", "is_uri"]
