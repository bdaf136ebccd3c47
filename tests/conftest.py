import sys
from pathlib import Path

# tests/ helpers (dist.py, parity.py) import as top-level modules, here and in spawned workers.
sys.path.insert(0, str(Path(__file__).parent))
