"""One module per `inferd` subcommand: each turns parsed arguments into calls to the packages below."""
