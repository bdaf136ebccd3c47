"""`python -m shardtrain ...` (and `torchrun -m shardtrain train ...`)."""

import sys

from shardtrain.cli import main

sys.exit(main())
