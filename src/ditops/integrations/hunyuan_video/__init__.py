"""HunyuanVideo and HunyuanVideo-1.5: the declarations (``family``, ``v15``), the joint
attention processor (``attention``) and the I2V token-replace blocks (``token_replace``)."""
