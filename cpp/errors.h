// Errors thrown from the core carry file and line so a Python traceback points at the C++ check.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace amoe {

// Raised as ValueError in Python (see module.cpp): the caller passed something the core cannot use.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace amoe

#define AMOE_CHECK_ARG(cond, msg)                                     \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::ostringstream amoe_oss_;                                   \
      amoe_oss_ << msg << " [" << __FILE__ << ":" << __LINE__ << "]"; \
      throw ::amoe::InvalidArgument(amoe_oss_.str());                 \
    }                                                                 \
  } while (0)
