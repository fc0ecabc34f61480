"""``make eval`` and ``make eval-nab``: how well fleetmedic finds faults and what it saves.

* :mod:`pipeline.eval.field` - published field failure rates and cause mixes (``field.toml``).
* :mod:`pipeline.eval.quality` - detection quality through the real pipeline (Kafka, Faust workers).
* :mod:`pipeline.eval.closedloop` - a 2,048-node cluster over 54 simulated days, four policies.
* :mod:`pipeline.eval.nab` - the Numenta Anomaly Benchmark: a scorer and fleetmedic's univariate detector on it.
* :mod:`pipeline.eval.report` - ``bench/results/eval.json``, plots and the summary in ``bench/README.md``.
"""
