"""The torch-free cost model, shared by the runtime and the planner: links of the
alpha-beta-gamma model (link.py), the time and bytes of every collective algorithm over
them (collectives.py, after Thakur, Rabenseifner and Gropp 2005), hardware presets and the
link a runtime group prices with (hardware.py), this machine's measured figures
(calibration.py), and closed-form parameter and FLOP counts of a model (counts.py).

Pure Python: nothing here imports torch or any runtime module (comm, parallel, train) or
the planner; comm's `auto` and the planner both import it, and whoever builds a process
group passes in the link it prices with.
"""
