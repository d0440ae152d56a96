"""The fleet-scale discrete-event simulator (`sprinter fleet`): its inputs (costs), the simulation
(engine), what it reports (result, report)."""
