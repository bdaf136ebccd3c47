"""Pipeline parallelism: partition (layer ranges per stage and chunk), schedules as data
(GPipe, 1F1B, interleaved 1F1B), the validator that proves them sound, the executor that
runs any valid one, and the stage module that holds one rank's part of the model."""
