"""The SDK: plans puts and gets against the index and runs them over the transports."""
