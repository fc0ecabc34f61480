"""What a training job imports to work with fleetmedic.

:mod:`fleetmedic.client` answers checkpoint-now requests (docs/checkpoint-now.md).  It
imports the standard library alone (a Kafka producer only when it sends through one), so
a training image can carry the single file ``fleetmedic/client.py`` without the
pipeline's dependencies.  Nothing is imported here, so ``python -m fleetmedic.client``
runs the module once.
"""
