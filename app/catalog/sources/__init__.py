"""Adapter sources: from a name or a source URI to a verified local adapter folder.

hub.py       AdapterHub: a name through the catalog, the local roots, then the Hub; a URI to its source
local.py     /path and file:///path (confined to the allowed roots when the request came over HTTP)
hf.py        hf://org/repo[@revision], through huggingface_hub's own cache (offline mode honoured)
s3.py        s3://bucket/prefix into the disk cache, and uploads to it; s3_api.py holds the boto3 calls
disk_cache.py  the local cache of downloaded adapters (atomic rename, LRU by bytes)
verify.py    which files make an adapter, the size limit, the sha256 checks"""

from app.catalog.sources.hub import AdapterHub
from app.catalog.sources.verify import ADAPTER_PATTERNS, adapter_files, hash_folder, is_adapter_file

__all__ = ["ADAPTER_PATTERNS", "AdapterHub", "adapter_files", "hash_folder", "is_adapter_file"]
