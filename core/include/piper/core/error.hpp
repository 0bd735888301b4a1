// Error types at the compiler's boundaries: each carries where the fault is (file, directive, field).
#pragma once

#include <stdexcept>
#include <string>

namespace piper::core {

// Base of every error the compiler reports to a user. what() is one line, ready to print.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A broken invariant of piper itself (not of the input): the CLI exits 3 and asks for a report.
// what() starts with "internal: ".
class InternalError : public Error {
 public:
  explicit InternalError(const std::string& message) : Error("internal: " + message) {}
};

// Bad model input: a zoo name, spec file or HF config. Message names the file and field.
class ModelError : public Error {
 public:
  using Error::Error;
};

// Bad directive program. Message names the file (if any), directive index and field.
class DirectiveError : public Error {
 public:
  DirectiveError(int index, const std::string& field, const std::string& message, const std::string& file = "")
      : Error((file.empty() ? "" : file + ": ") + "directive " + std::to_string(index) +
              (field.empty() ? "" : " field '" + field + "'") + ": " + message),
        index_(index),
        field_(field),
        message_(message) {}
  // The same error, located in `file`.
  DirectiveError in_file(const std::string& file) const { return DirectiveError(index_, field_, message_, file); }
  int index() const { return index_; }
  const std::string& field() const { return field_; }

 private:
  int index_;
  std::string field_;
  std::string message_;
};

// A plan that fails verification or cannot be read back.
class PlanError : public Error {
 public:
  using Error::Error;
};

}  // namespace piper::core
