// Number formatting shared by the planner's files (plan/*.cpp): one spelling of GB, counts and fixed decimals in
// every table build/plan prints.
#pragma once

#include <cstdio>
#include <string>

namespace tuna::plan_text {

inline std::string format_number(double x, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, x);
  return buf;
}

inline std::string gb(double bytes) { return format_number(bytes / 1e9, 2) + " GB"; }

// 1.23B, 45.6M: parameter and token counts.
inline std::string human_count(double x) {
  char buf[32];
  if (x >= 1e12) std::snprintf(buf, sizeof buf, "%.2fT", x / 1e12);
  else if (x >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", x / 1e9);
  else if (x >= 1e6) std::snprintf(buf, sizeof buf, "%.1fM", x / 1e6);
  else if (x >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", x / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

}  // namespace tuna::plan_text
