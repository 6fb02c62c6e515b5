def verify_module(module):
    pass
