"""Harnesses and small models the tests share: nothing here is a test."""
