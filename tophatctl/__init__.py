"""The operator's tools: the `tophat` command line, the local launcher, network
namespaces for link emulation, the chat client, the demo and the demo-model builder.
Nothing here is imported by a service."""
