"""(populated by the module authors)"""
