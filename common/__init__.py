"""What the stage service and the coordinator share: the core's messages (`batch`, `sampling`), their wire
mapping and tensor codec (`wire`, `codec`), settings declared once (`options`), logging (`logs`), and what
every SpecPipe gRPC server and process sets up (`grpc_server`, `malformed`, `tls`, `memory`,
`metrics_http`). It imports neither `services` nor `coordinator`."""
