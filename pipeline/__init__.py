"""fleetmedic's pipeline: the Faust app, the correlator's policy, the simulator and the CLI."""
