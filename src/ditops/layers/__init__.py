"""nn.Modules users put in models: each is a registered CustomOp."""
