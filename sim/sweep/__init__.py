"""The network sweep (`sprinter simulate`): real cloud and edge processes over the emulated link,
every RTT x method x prompt, then quality, a report with plots and a fleet-simulator validation;
the fleet plane's telemetry of the run is recorded and plotted too."""
