"""Launch-time work before the first step: run-dir preparation, the fits check, the dry run over
a fake process group, and compute calibration."""
