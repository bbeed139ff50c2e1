"""Runtime code shared by the Triton models, the gateway and the exporter, in layers (docs/architecture.md, "Where
things are"): errors and model_config, rules/, stage_io and duplex_contract, media/, engine/ and vocoder/, stages/,
serving/. torch only in the device parts, imported where one is built."""
